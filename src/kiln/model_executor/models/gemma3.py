"""Gemma 3 (Google), text only: Gemma 2's blocks with per-head q/k norms and two rotary bases.

Same contract as ``kiln.model_executor.models.llama`` (which see); the blocks are Gemma 2's
(``kiln.model_executor.models.gemma2``: scaled embeddings, ``(1 + w)`` norms, GeGLU, sandwich
norms, ``query_pre_attn_scalar``, soft caps where the config sets them, which released Gemma 3
configs do not). Differences from Gemma 2:
- ``q_norm`` / ``k_norm``: a ``GemmaRMSNorm(head_dim)`` on every query and key head before the
  rotation (as Qwen3's, with Gemma's norm);
- sliding-window layers rotate with their own base, ``rope_local_base_freq`` (transformers 5:
  ``rope_parameters["sliding_attention"]``), unscaled; the global layers with ``rope_theta`` and
  ``rope_scaling`` (``rope_parameters["full_attention"]``; linear scaling in the larger models);
- without ``layer_types``, every ``sliding_window_pattern``-th layer (default 6) is global, the
  others slide.

Only ``Gemma3ForCausalLM`` checkpoints (the text-only 1B, or a multimodal model's language part
saved as one) are served; ``Gemma3ForConditionalGeneration``'s vision tower is not.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kiln.model_executor.layers.layernorm import GemmaRMSNorm
from kiln.model_executor.models.gemma2 import Gemma2ForCausalLM, GemmaArgs
from kiln.model_executor.models.llama import LlamaForCausalLM, config_dict, rope_config
from kiln.model_executor.models.qwen3 import Qwen3Attention

DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}
"""Gemma 3's rotary bases when the config names none."""


class Gemma3Attention(Qwen3Attention):
    """Llama attention with a Gemma norm on each q and k head before the rotation."""

    norm_cls = GemmaRMSNorm


def gemma3_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    """``(global theta, global rope scaling or None, local theta)`` from transformers 5's
    per-layer-type ``rope_parameters`` or the older ``rope_theta`` / ``rope_scaling`` /
    ``rope_local_base_freq`` keys.

    Raises:
        ValueError: scaling on the sliding-window layers' rotary embedding.
    """
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = params.get("full_attention") or {}
        local = params.get("sliding_attention") or {}
        theta, scaling = rope_config(
            {"rope_parameters": {"rope_theta": DEFAULT_THETA["full_attention"], **full}}
        )
        if local.get("rope_type", "default") != "default":
            raise ValueError(
                f"Gemma3ForCausalLM: rope_parameters['sliding_attention'] rope_type="
                f"{local['rope_type']!r} is not supported; allowed: 'default'"
            )
        local_theta = float(local.get("rope_theta", DEFAULT_THETA["sliding_attention"]))
        return theta, scaling, local_theta
    theta = float(cfg.get("rope_theta") or DEFAULT_THETA["full_attention"])
    scaling = cfg.get("rope_scaling") or None
    local_theta = float(cfg.get("rope_local_base_freq") or DEFAULT_THETA["sliding_attention"])
    return theta, scaling, local_theta


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 causal LM (text)."""

    attention_cls = Gemma3Attention

    @classmethod
    def parse_config(cls, hf_config: Any) -> GemmaArgs:
        """Gemma 2's parsing with Gemma 3's rotary bases.

        Raises:
            ValueError: see ``Gemma2ForCausalLM.parse_config`` and ``gemma3_rope``.
        """
        cfg = config_dict(hf_config)
        theta, scaling, local_theta = gemma3_rope(cfg)
        # The parent reads plain rope keys: hand it the global layers' rotary embedding.
        plain = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "rope_scaling")}
        args = super().parse_config({**plain, "rope_theta": theta})
        return dataclasses.replace(args, rope_scaling=scaling, local_rope_theta=local_theta)

    @staticmethod
    def sliding_windows(cfg: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
        """``sliding_window`` on the ``layer_types`` marked ``sliding_attention``; without
        ``layer_types``, on every layer but each ``sliding_window_pattern``-th."""
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        types = cfg.get("layer_types") or [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(num_layers)
        ]
        return LlamaForCausalLM.sliding_windows(
            {"sliding_window": cfg.get("sliding_window"), "layer_types": types}, num_layers
        )


__all__ = ["Gemma3Attention", "Gemma3ForCausalLM", "gemma3_rope"]
