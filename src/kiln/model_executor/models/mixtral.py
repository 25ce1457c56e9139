"""Mixtral (Mistral AI): Llama attention and a sparse MoE block on every layer.

Same contract as ``kiln.model_executor.models.llama`` (which see). Differences from Llama: every
layer's MLP is ``num_local_experts`` SwiGLU experts, of which each token takes the
``num_experts_per_tok`` (2) with the highest softmax router scores, their weights renormalized
to sum to 1 (``kiln.model_executor.models.moe``); a ``sliding_window``, when set, applies on every
layer (as Mistral's). The checkpoint's ``block_sparse_moe`` module is Kiln's ``mlp``; its experts
are ``experts.N.w1`` (gate), ``w3`` (up) and ``w2`` (down), or stacked (transformers 5).
"""

from __future__ import annotations

from typing import Any

from kiln.model_executor.models.llama import LlamaForCausalLM
from kiln.model_executor.models.moe import MoEModelMixin


class MixtralForCausalLM(MoEModelMixin, LlamaForCausalLM):
    """Mixtral causal LM (8x7B, 8x22B and their fine-tunes)."""

    expert_names = {"w1": "gate", "w3": "up", "w2": "down"}

    @classmethod
    def moe_fields(cls, cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
        return dict(
            num_experts=int(cfg["num_local_experts"]),
            top_k=int(cfg.get("num_experts_per_tok", 2)),
            moe_intermediate_size=int(cfg["intermediate_size"]),
            renormalize=True,
            sparse_layers=(True,) * num_layers,
        )

    def rename_checkpoint(self, name: str) -> str:
        return name.replace(".block_sparse_moe.", ".mlp.")


__all__ = ["MixtralForCausalLM"]
