"""Qwen3-MoE: Qwen3's attention (q/k RMSNorm per head) and sparse MoE blocks.

Same contract as ``kiln.model_executor.models.llama`` (which see). Differences from Qwen3: a
layer's MLP is the sparse block (``num_experts`` experts of ``moe_intermediate_size``, each token
taking the ``num_experts_per_tok`` with the highest softmax router scores, renormalized when
``norm_topk_prob``) unless the layer is in ``mlp_only_layers`` or ``(layer + 1)`` is not a
multiple of ``decoder_sparse_step``; those layers keep a dense MLP of ``intermediate_size``
(Hugging Face's rule). A ``sliding_window`` applies on every layer when ``use_sliding_window``.
"""

from __future__ import annotations

from typing import Any

from kiln.model_executor.models.moe import MoEModelMixin
from kiln.model_executor.models.qwen3 import Qwen3ForCausalLM


def qwen3_moe_sliding_windows(cfg: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """``sliding_window`` on every layer when ``use_sliding_window``, else none."""
    window = cfg.get("sliding_window")
    if not cfg.get("use_sliding_window", False) or window is None:
        return (None,) * num_layers
    return (int(window),) * num_layers


class Qwen3MoeForCausalLM(MoEModelMixin, Qwen3ForCausalLM):
    """Qwen3-MoE causal LM (30B-A3B, 235B-A22B)."""

    sliding_windows = staticmethod(qwen3_moe_sliding_windows)

    @classmethod
    def moe_fields(cls, cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
        num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        step = int(cfg.get("decoder_sparse_step", 1))
        dense = set(cfg.get("mlp_only_layers") or ())
        sparse = tuple(
            num_experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(num_layers)
        )
        return dict(
            num_experts=num_experts,
            top_k=int(cfg.get("num_experts_per_tok", 1)),
            moe_intermediate_size=int(cfg["moe_intermediate_size"]),
            renormalize=bool(cfg.get("norm_topk_prob", False)),
            sparse_layers=sparse,
        )


__all__ = ["Qwen3MoeForCausalLM", "qwen3_moe_sliding_windows"]
