"""Qwen3 (dense): the Llama blocks plus a per-head RMSNorm on q and k before the rotary embedding.

Same contract as ``kiln.model_executor.models.llama`` (which see). Differences from Llama: each
attention layer has ``q_norm`` and ``k_norm`` (``RMSNorm(head_dim)``, applied to every head), the
``head_dim`` comes from the config (it is not ``hidden / heads`` in most Qwen3 sizes), q/k/v and o
biases follow ``attention_bias`` (off in released models), and windows follow Qwen's rule.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from kiln.model_executor.layers.layernorm import RMSNorm
from kiln.model_executor.layers.linear import QuantizationConfig
from kiln.model_executor.layers.rotary_embedding import RotaryEmbedding
from kiln.model_executor.models.llama import DecoderArgs, LlamaAttention, LlamaForCausalLM
from kiln.model_executor.models.qwen2 import qwen_sliding_windows


class Qwen3Attention(LlamaAttention):
    """Llama attention with q/k RMSNorm per head before the rotation."""

    norm_cls: ClassVar[type[RMSNorm]] = RMSNorm  # of q and k

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
        self.q_norm = self.norm_cls(args.head_dim, args.rms_norm_eps, dtype)
        self.k_norm = self.norm_cls(args.head_dim, args.rms_norm_eps, dtype)

    def embed_positions(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens = q.shape[0]
        # [T, H * D] -> [T, H, D] (a view: only the last dim is split) -> normed -> [T, H * D]
        q = self.q_norm(q.view(num_tokens, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(num_tokens, self.num_kv_heads, self.head_dim))
        return super().embed_positions(
            positions, q.view(num_tokens, self.q_size), k.view(num_tokens, self.kv_size)
        )


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 causal LM (dense)."""

    attention_cls = Qwen3Attention
    sliding_windows = staticmethod(qwen_sliding_windows)


__all__ = ["Qwen3Attention", "Qwen3ForCausalLM"]
