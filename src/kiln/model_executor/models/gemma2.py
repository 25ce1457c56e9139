"""Gemma 2 (Google): the Llama attention in sandwich-normed blocks, with a GeGLU MLP, scaled
embeddings and soft-capped attention scores and logits.

Same contract as ``kiln.model_executor.models.llama`` (which see). Differences from Llama:
- the token embeddings are multiplied by ``sqrt(hidden_size)`` rounded to the model dtype (as
  Hugging Face does: 55.5, not 55.43, for a hidden size of 3072 in bfloat16);
- every norm is a ``GemmaRMSNorm``: scale ``1 + w``, computed in float32;
- each block norms the input *and* the output of both sub-layers (``input_layernorm``,
  ``post_attention_layernorm``, ``pre_feedforward_layernorm``, ``post_feedforward_layernorm``):
  ``h = x + post_attn(attn(input(x)))``, ``out = h + post_ff(mlp(pre_ff(h)))``;
- the MLP is GeGLU: ``hidden_activation`` ``gelu_pytorch_tanh`` (tanh approximation) or ``gelu``;
- the attention scale is ``query_pre_attn_scalar ** -0.5``, not ``head_dim ** -0.5``; attention
  scores are soft-capped at ``attn_logit_softcapping`` and the logits at
  ``final_logit_softcapping`` (``cap * tanh(x / cap)``; null: no cap);
- ``sliding_window`` applies on the layers ``layer_types`` marks ``sliding_attention``; configs
  without ``layer_types`` alternate, from layer 0 (``sliding_windows``);
- the LM head is tied to the embedding unless ``tie_word_embeddings`` is false; ``head_dim``
  comes from the config, independent of ``hidden_size / num_attention_heads``.

Bidirectional attention (``use_bidirectional_attention``, an embedding variant) is refused.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from kiln.model_executor.layers.activation import GeluAndMul
from kiln.model_executor.layers.layernorm import GemmaRMSNorm
from kiln.model_executor.layers.linear import QuantizationConfig
from kiln.model_executor.models.llama import (
    DecoderArgs,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    config_dict,
)

GELU_APPROXIMATE = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}
"""Hugging Face's ``hidden_activation`` -> ``GeluAndMul``'s ``approximate``."""


@dataclass(frozen=True)
class GemmaArgs(DecoderArgs):
    """``DecoderArgs`` plus what only Gemma's blocks read."""

    gelu_approximate: str = "tanh"
    final_logit_softcap: float | None = None
    """Logits ``x`` become ``cap * tanh(x / cap)``; None: no cap."""


def soft_cap(value: Any) -> float | None:
    """A config's soft-capping value: None (or 0) means no cap."""
    return float(value) if value else None


class GemmaMLP(LlamaMLP):
    """GeGLU: ``down(gelu(gate(x)) * up(x))``, gate and up fused into one matmul."""

    def __init__(
        self,
        args: GemmaArgs,
        dtype: torch.dtype,
        quant_config: QuantizationConfig | None,
        prefix: str,
    ) -> None:
        super().__init__(args, dtype, quant_config, prefix)
        self.act_fn = GeluAndMul(args.gelu_approximate)


class GemmaDecoderLayer(LlamaDecoderLayer):
    """Sandwich-normed block (see the module docstring); the residual stream is carried beside
    the hidden states, as in Llama's blocks (the next norm adds it)."""

    mlp_cls = GemmaMLP

    def add_norms(self, args: DecoderArgs, dtype: torch.dtype) -> None:
        size, eps = args.hidden_size, args.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(normed mlp output, residual)``; their sum is the layer's output."""
        hidden_states, residual = self.norm_input(hidden_states, residual)
        hidden_states = self.post_attention_layernorm(self.self_attn(positions, hidden_states))
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden_states)), residual


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2 causal LM."""

    decoder_layer_cls: ClassVar[type[nn.Module]] = GemmaDecoderLayer
    norm_cls = GemmaRMSNorm

    def __init__(
        self,
        hf_config: Any,
        dtype: torch.dtype = torch.float32,
        prefix: str = "",
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        super().__init__(hf_config, dtype, prefix, quant_config)
        # sqrt(hidden_size) rounded to the model dtype, as Hugging Face multiplies by it.
        scale = torch.tensor(self.args.embedding_multiplier, dtype=dtype)
        self.model.embedding_multiplier = float(scale)

    @classmethod
    def parse_config(cls, hf_config: Any) -> GemmaArgs:
        """Llama's parsing with Gemma's activation, scales, soft caps and defaults.

        Raises:
            ValueError: a ``hidden_activation`` other than ``gelu_pytorch_tanh`` / ``gelu``,
                ``use_bidirectional_attention``, or what Llama's parsing refuses.
        """
        cfg = config_dict(hf_config)
        name = cls.__name__
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in GELU_APPROXIMATE:
            raise ValueError(
                f"{name}: hidden_activation={act!r} is not supported; "
                f"allowed: {sorted(GELU_APPROXIMATE)}"
            )
        if cfg.get("use_bidirectional_attention"):
            raise ValueError(
                f"{name}: use_bidirectional_attention=True (an embedding model's attention) is "
                "not supported; allowed: false or null"
            )
        defaults = {"head_dim": 256, "tie_word_embeddings": True}
        cfg = {**cfg, **{k: v for k, v in defaults.items() if cfg.get(k) is None}}
        # Llama's parsing refuses a non-SiLU activation; Gemma's was checked above.
        args = super().parse_config({**cfg, "hidden_act": "silu"})
        fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
        fields.update(
            attention_scale=float(cfg.get("query_pre_attn_scalar") or args.head_dim) ** -0.5,
            embedding_multiplier=args.hidden_size**0.5,
            attn_logit_softcap=soft_cap(cfg.get("attn_logit_softcapping")),
            final_logit_softcap=soft_cap(cfg.get("final_logit_softcapping")),
            gelu_approximate=GELU_APPROXIMATE[act],
        )
        return GemmaArgs(**fields)

    @staticmethod
    def sliding_windows(cfg: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
        """``sliding_window`` on the ``layer_types`` marked ``sliding_attention``; without
        ``layer_types``, on even layers (0, 2, ...), as Gemma 2's configs default."""
        window = cfg.get("sliding_window")
        types = cfg.get("layer_types") or [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)
        ]
        return LlamaForCausalLM.sliding_windows(
            {"sliding_window": window, "layer_types": types}, num_layers
        )

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32, soft-capped at ``final_logit_softcapping``."""
        logits = super().compute_logits(hidden_states)
        assert isinstance(self.args, GemmaArgs)
        cap = self.args.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


__all__ = ["GemmaArgs", "GemmaDecoderLayer", "GemmaMLP", "Gemma2ForCausalLM", "soft_cap"]
