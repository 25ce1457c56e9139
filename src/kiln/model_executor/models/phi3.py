"""Phi-3 (Microsoft): the Llama blocks, loaded from a checkpoint whose projections are fused.

Same contract as ``kiln.model_executor.models.llama`` (which see). Phi-3's checkpoints store
``self_attn.qkv_proj`` (rows ``[q | k | v]``) and ``mlp.gate_up_proj`` (rows ``[gate | up]``) as
one tensor each; ``load_weights`` splits them into the q/k/v and gate/up parts that Kiln's fused
layers load shard by shard, so each tensor-parallel rank keeps its own heads and columns. A
``sliding_window`` applies on every layer (as Mistral's). Only plain rope is served: the
long-context ``longrope`` (formerly ``su``) scaling and partial rotary embeddings are refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from kiln.model_executor.models.llama import DecoderArgs, LlamaForCausalLM, config_dict

UNSUPPORTED_ROPE_TYPES = ("longrope", "su")


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 causal LM (mini, small, medium; 4k-context variants)."""

    @classmethod
    def parse_config(cls, hf_config: Any) -> DecoderArgs:
        """Llama's parsing, after refusing what Kiln's rope does not implement.

        Raises:
            ValueError: ``rope_scaling`` of type longrope / su, or a ``partial_rotary_factor``
                other than 1.
        """
        cfg = config_dict(hf_config)
        args = super().parse_config(hf_config)
        scaling = args.rope_scaling or {}
        rope_type = scaling.get("rope_type", scaling.get("type"))
        if rope_type in UNSUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"Phi3ForCausalLM: rope_scaling type {rope_type!r} (Phi-3's long-context "
                "scaling) is not supported; use a checkpoint without rope_scaling "
                "(the 4k-context Phi-3 models)"
            )
        # Top level in older configs, in rope_parameters in transformers 5's.
        params = cfg.get("rope_parameters") or {}
        factors = (cfg.get("partial_rotary_factor"), params.get("partial_rotary_factor"))
        partial = [float(f) for f in factors if f is not None and float(f) != 1.0]
        if partial:
            raise ValueError(
                f"Phi3ForCausalLM: partial_rotary_factor={partial[0]} is not supported; "
                "allowed: 1.0"
            )
        return args

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Llama's ``load_weights`` on the checkpoint with its fused projections split."""
        return super().load_weights(self._split_fused(weights))

    def _split_fused(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``qkv_proj`` -> ``q/k/v_proj`` and ``gate_up_proj`` -> ``gate/up_proj`` (rows, as
        Hugging Face's Phi-3 splits its outputs); other tensors pass through."""
        args = self.args
        q_size = args.num_heads * args.head_dim
        kv_size = args.num_kv_heads * args.head_dim
        for name, tensor in weights:
            if ".qkv_proj." in name:
                q, k, v = tensor.split([q_size, kv_size, kv_size], dim=0)
                for part, shard in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                    yield name.replace(".qkv_proj.", f".{part}."), shard
            elif ".gate_up_proj." in name:
                gate, up = tensor.chunk(2, dim=0)
                yield name.replace(".gate_up_proj.", ".gate_proj."), gate
                yield name.replace(".gate_up_proj.", ".up_proj."), up
            else:
                yield name, tensor


__all__ = ["Phi3ForCausalLM"]
