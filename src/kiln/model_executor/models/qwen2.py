"""Qwen2 / Qwen2.5: the Llama blocks with biased q/k/v projections and Qwen's sliding-window rule.

Same contract as ``kiln.model_executor.models.llama`` (which see); this module only changes how the
config maps onto ``DecoderArgs``: ``q/k/v_proj`` always have a bias, ``o_proj`` never does, and a
sliding window applies only when ``use_sliding_window`` is set.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kiln.model_executor.models.llama import DecoderArgs, LlamaForCausalLM


def qwen_sliding_windows(cfg: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Qwen's per-layer windows: none unless ``use_sliding_window``; then the layers that
    ``layer_types`` marks ``sliding_attention`` or, in older configs, layers from
    ``max_window_layers`` on (Hugging Face's rule)."""
    window = cfg.get("sliding_window")
    if not cfg.get("use_sliding_window", False) or window is None:
        return (None,) * num_layers
    layer_types = cfg.get("layer_types")
    if layer_types:
        return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
    first = int(cfg.get("max_window_layers", num_layers))
    return tuple(int(window) if i >= first else None for i in range(num_layers))


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 causal LM."""

    sliding_windows = staticmethod(qwen_sliding_windows)

    @classmethod
    def parse_config(cls, hf_config: Any) -> DecoderArgs:
        args = super().parse_config(hf_config)
        return dataclasses.replace(args, qkv_bias=True, o_proj_bias=False, mlp_bias=False)


__all__ = ["Qwen2ForCausalLM", "qwen_sliding_windows"]
