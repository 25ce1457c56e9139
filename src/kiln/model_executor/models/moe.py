"""The mixture-of-experts blocks that Mixtral and Qwen3-MoE share: a router and a ``FusedMoE`` in
place of the dense MLP on the sparse layers.

Same contract as ``kiln.model_executor.models.llama`` (which see). An MoE model class mixes
``MoEModelMixin`` into a Llama-family class: ``parse_config`` adds the routing fields
(``MoEDecoderArgs``), ``decoder_layer_cls`` builds ``SparseMoeBlock`` as the ``mlp`` of every
layer ``is_sparse_layer`` picks, and ``load_weights`` loads the experts' tensors (per expert or
stacked: ``kiln.model_executor.layers.fused_moe.expert_shard``) into the stacked parameters,
passing the rest to the dense loader. The router stays unquantized and replicated on every rank;
the experts are dense (``--quantization`` applies to the attention and dense layers only).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from kiln.model_executor.layers.fused_moe import FusedMoE, expert_shard, shard_keys
from kiln.model_executor.layers.linear import QuantizationConfig, ReplicatedLinear
from kiln.model_executor.models.llama import (
    DecoderArgs,
    LlamaDecoderLayer,
    config_dict,
    join_prefix,
)
from kiln.model_executor.models.pipeline import is_on_other_stage


@dataclass(frozen=True)
class MoEDecoderArgs(DecoderArgs):
    """``DecoderArgs`` plus the routing of the sparse layers."""

    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    """Each expert's intermediate size (``intermediate_size`` stays the dense layers')."""
    renormalize: bool = True
    """Divide the chosen experts' weights by their sum."""
    sparse_layers: tuple[bool, ...] = ()
    """Per layer: whether its MLP is the sparse block."""


class SparseMoeBlock(nn.Module):
    """``experts(x, gate(x))``: router logits [T, E] from a replicated linear, then the op."""

    def __init__(self, args: MoEDecoderArgs, dtype: torch.dtype, prefix: str) -> None:
        super().__init__()
        self.gate = ReplicatedLinear(
            args.hidden_size,
            args.num_experts,
            bias=False,
            params_dtype=dtype,
            prefix=join_prefix(prefix, "gate"),
        )
        self.experts = FusedMoE(
            args.num_experts,
            args.top_k,
            args.hidden_size,
            args.moe_intermediate_size,
            renormalize=args.renormalize,
            params_dtype=dtype,
            prefix=join_prefix(prefix, "experts"),
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # [T, hidden] -> logits [T, E] -> [T, hidden]
        return self.experts(hidden_states, self.gate(hidden_states))


class MoEDecoderLayer(LlamaDecoderLayer):
    """A Llama-style block whose MLP is the sparse block where ``args.sparse_layers`` says."""

    def make_mlp(
        self,
        args: DecoderArgs,
        layer_idx: int,
        dtype: torch.dtype,
        quant_config: QuantizationConfig | None,
        prefix: str,
    ) -> nn.Module:
        assert isinstance(args, MoEDecoderArgs)  # MoEModelMixin.parse_config made it
        if args.sparse_layers[layer_idx]:
            return SparseMoeBlock(args, dtype, prefix)
        return super().make_mlp(args, layer_idx, dtype, quant_config, prefix)


class MoEModelMixin:
    """Routing config, sparse layers and expert loading for a Llama-family class (listed first
    among its bases, so that its ``parse_config`` and ``load_weights`` wrap the dense ones)."""

    decoder_layer_cls: ClassVar[type[nn.Module]] = MoEDecoderLayer
    expert_names: ClassVar[dict[str, str]] = {
        "gate_proj": "gate",
        "up_proj": "up",
        "down_proj": "down",
    }
    """The checkpoint's per-expert projection names -> ``FusedMoE`` parts."""

    @classmethod
    def moe_fields(cls, cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
        """The ``MoEDecoderArgs`` fields of a config (each model class says how)."""
        raise NotImplementedError

    @classmethod
    def parse_config(cls, hf_config: Any) -> MoEDecoderArgs:
        """The dense parsing plus ``moe_fields``.

        Raises:
            ValueError: as the dense parsing; ``num_experts_per_tok`` outside 1 to the number of
                experts.
        """
        cfg = config_dict(hf_config)
        args = super().parse_config(hf_config)  # type: ignore[misc]
        fields = cls.moe_fields(cfg, args.num_layers)
        if not 1 <= fields["top_k"] <= fields["num_experts"]:
            raise ValueError(
                f"num_experts_per_tok={fields['top_k']} is out of range; allowed: 1 to the "
                f"number of experts ({fields['num_experts']})"
            )
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
        return MoEDecoderArgs(**values, **fields)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The dense ``load_weights`` with the experts' tensors loaded into ``FusedMoE``.

        Returns:
            as the dense loader; a stacked expert parameter counts once every expert's pieces
            (gate and up, or down) were seen.

        Raises:
            ValueError: an expert tensor has no matching parameter or does not fit.
        """
        params = dict(self.named_parameters())  # type: ignore[attr-defined]
        seen: dict[str, set[tuple[int, str]]] = {}
        loaded = super().load_weights(self._load_experts(weights, params, seen))  # type: ignore[misc]
        num_experts = self._num_experts()
        for name, pieces in seen.items():
            wanted = ("down",) if name.endswith("w2_weight") else ("gate", "up")
            if pieces == {(e, p) for e in range(num_experts) for p in wanted}:
                loaded.add(name)
        return loaded

    def _num_experts(self) -> int:
        args = self.args  # type: ignore[attr-defined]
        assert isinstance(args, MoEDecoderArgs)  # parse_config made it
        return args.num_experts

    def rename_checkpoint(self, name: str) -> str:
        """A checkpoint name as Kiln's modules spell it (Mixtral renames its MoE block)."""
        return name

    def _load_experts(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        params: dict[str, nn.Parameter],
        seen: dict[str, set[tuple[int, str]]],
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Load the expert tensors of ``weights`` (recording their pieces in ``seen``); yield
        the others, renamed."""
        for hf_name, tensor in weights:
            name = self.rename_checkpoint(hf_name)
            target = expert_shard(name, self.expert_names)
            if target is None:
                yield name, tensor
                continue
            param_name, shard_id = target
            param = params.get(param_name)
            if param is None and is_on_other_stage(self, param_name):  # type: ignore[arg-type]
                continue
            if param is None:
                raise ValueError(
                    f"checkpoint tensor {hf_name!r} matches no parameter of "
                    f"{type(self).__name__} (looked for {param_name!r})"
                )
            param.weight_loader(param, tensor, shard_id)  # type: ignore[attr-defined]
            keys = shard_keys(shard_id, self._num_experts())
            seen.setdefault(param_name, set()).update(keys)


__all__ = ["MoEDecoderArgs", "MoEDecoderLayer", "MoEModelMixin", "SparseMoeBlock"]
