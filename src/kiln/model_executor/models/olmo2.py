"""OLMo 2 (AI2): Llama's attention and MLP in post-norm blocks, with q/k norms over the whole
projections.

Same contract as ``kiln.model_executor.models.llama`` (which see). Differences from Llama:
- each block normalizes the *outputs* of its sub-layers before the residual add
  (``h = x + post_attention_layernorm(attn(x))``, ``out = h + post_feedforward_layernorm(mlp(h))``)
  and has no input norm; the final norm is Llama's;
- ``q_norm`` / ``k_norm`` are RMSNorms over the whole q and k projections (every head at once,
  weights of ``num_heads * head_dim`` and ``num_kv_heads * head_dim``), before the rotation; with
  tensor parallelism their statistics are summed over the ranks' heads (``ShardedRMSNorm``).
"""

from __future__ import annotations

import torch

from kiln.model_executor.layers.layernorm import RMSNorm, ShardedRMSNorm
from kiln.model_executor.layers.linear import QuantizationConfig
from kiln.model_executor.layers.rotary_embedding import RotaryEmbedding
from kiln.model_executor.models.llama import (
    DecoderArgs,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
)


class Olmo2Attention(LlamaAttention):
    """Llama attention with RMSNorm over the whole q and k projections before the rotation."""

    def __init__(
        self,
        args: DecoderArgs,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        dtype: torch.dtype,
        quant_config: QuantizationConfig | None,
        prefix: str,
    ) -> None:
        super().__init__(args, layer_idx, rotary_emb, dtype, quant_config, prefix)
        qkv, head_dim = self.qkv_proj, args.head_dim
        self.q_norm = ShardedRMSNorm(
            self.q_size,
            args.rms_norm_eps,
            dtype,
            shard_start=qkv.q_head_start * head_dim,
            num_summed=qkv.total_num_heads * head_dim,
            tp_group=qkv.tp_group,
        )
        # With fewer KV heads than ranks every rank holds one (replicated): tp_size copies.
        self.k_norm = ShardedRMSNorm(
            self.kv_size,
            args.rms_norm_eps,
            dtype,
            shard_start=qkv.kv_head_start * head_dim,
            num_summed=max(qkv.total_num_kv_heads, qkv.tp_size) * head_dim,
            tp_group=qkv.tp_group,
        )

    def embed_positions(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # q [T, H * D], k [T, Hkv * D]: normed over all their heads, then rotated.
        return super().embed_positions(positions, self.q_norm(q), self.k_norm(k))


class Olmo2DecoderLayer(LlamaDecoderLayer):
    """Post-norm block: each sub-layer's output is normed, then added to the residual stream."""

    def __init__(
        self,
        args: DecoderArgs,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        attention_cls: type[LlamaAttention],
        dtype: torch.dtype,
        quant_config: QuantizationConfig | None,
        prefix: str,
    ) -> None:
        super().__init__(args, layer_idx, rotary_emb, attention_cls, dtype, quant_config, prefix)
        del self.input_layernorm  # nothing normalizes the block's input
        self.post_feedforward_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(normed mlp output, residual)``; their sum is the layer's output."""
        if residual is not None:
            hidden_states = hidden_states + residual  # the previous layer's output
        attn = self.self_attn(positions, hidden_states)
        residual = hidden_states + self.post_attention_layernorm(attn)
        return self.post_feedforward_layernorm(self.mlp(residual)), residual


class Olmo2ForCausalLM(LlamaForCausalLM):
    """OLMo 2 causal LM."""

    attention_cls = Olmo2Attention
    decoder_layer_cls = Olmo2DecoderLayer


__all__ = ["Olmo2Attention", "Olmo2DecoderLayer", "Olmo2ForCausalLM"]
