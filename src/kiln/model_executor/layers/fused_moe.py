"""Mixture of experts as one op: ``fused_moe`` routes each token to its top-k experts and sums
their SwiGLU outputs, weighted by the router.

Contract of the op (``FusedMoE.forward_native(hidden_states, router_logits)``):
- ``hidden_states`` [T, H] in the model dtype; ``router_logits`` [T, E] (any float dtype);
- the layer holds the stacked weights of its local experts ``w13_weight`` [L, 2 * I, H] (per
  expert the gate rows, then the up rows, as one fused projection) and ``w2_weight`` [L, H, I]
  (down), and the attributes ``top_k``, ``renormalize``, ``scoring_func`` (``"softmax"`` or
  ``"sigmoid"``) and ``expert_offset``. The local experts are the global experts
  ``expert_offset .. expert_offset + L - 1`` (``w13_weight[i]`` is expert ``expert_offset + i``).
  Without expert parallelism ``L = E``, ``expert_offset = 0`` and ``I`` is this rank's share of
  the intermediate size; with it (``parallel.enable_expert_parallel``, N ranks) rank r holds
  ``L = E / N`` whole experts from ``expert_offset = r * L``, and ``I`` is the whole size;
- routing (``select_experts``): scores = softmax or sigmoid of the logits in float32; each token
  takes its ``top_k`` highest-scoring experts; with ``renormalize`` their weights are divided by
  their sum;
- result [T, H] in ``hidden_states``' dtype:
  ``sum_k weight[t, k] * w2[e] @ (silu(gate_e(x_t)) * up_e(x_t))`` over the chosen experts
  ``e = ids[t, k]``, accumulated in float32 and rounded once, where routing is over all E
  experts and only the local experts' terms are summed (a token routed to another rank's experts
  gets zero from them here). With tensor or expert parallelism it is this rank's partial sum
  (its slice of ``I``, or its experts); the layer all-reduces it through the platform's
  communicator after the dispatched op, as ``RowParallelLinear`` does, so an implementation
  never sees the other ranks. An implementation must read only the routed local experts'
  weights; one that handles only ``expert_offset == 0`` with ``L == E`` must say so in its
  ``supports``.

The reference, ``fused_experts_reference``, loops over the experts that some token chose and
multiplies each one's tokens as a batch: only the routed experts' weights are read, and nothing
is computed for the others. Under graph capture (``is_capturing()``) it runs as the opaque op
``torch.ops.kiln.fused_moe``, since its loop depends on the routing, which a trace would freeze.

Shared experts (DeepSeek's, Qwen2-MoE's) are a dense MLP module the layer adds to the routed sum
after the all-reduce (``shared_experts``, reduced by its own row-parallel projection).

Checkpoints: ``weight_loader(param, tensor, (expert, part))`` with ``expert`` the expert index,
or None for a tensor of every expert stacked (transformers 5's ``experts.gate_up_proj`` [E, 2I,
H] / ``experts.down_proj`` [E, H, I]), and ``part`` one of ``"gate"``, ``"up"``, ``"gate_up"``
(into ``w13_weight``) or ``"down"`` (into ``w2_weight``); each rank keeps its slice of ``I``,
or with expert parallelism its experts whole (other experts' tensors are skipped, a stacked
tensor narrowed to the local experts).

This module knows nothing about models or platforms.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from kiln.distributed.parallel_state import (
    TensorParallelGroup,
    divide,
    set_tp_group,
    tp_group_for,
)
from kiln.model_executor.custom_op import CustomOp, is_capturing, register_op
from kiln.model_executor.layers.linear import set_weight_attrs

SCORING_FUNCS = ("softmax", "sigmoid")
W13_PARTS = ("gate", "up", "gate_up")
W2_PARTS = ("down",)


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, scoring_func: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Route each token: ``(weights [T, top_k] float32, expert ids [T, top_k] int64)``, highest
    score first; see the module docstring."""
    logits = router_logits.float()
    scores = logits.softmax(dim=-1) if scoring_func == "softmax" else logits.sigmoid()
    weights, ids = torch.topk(scores, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_experts_reference(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_offset: int = 0,
) -> torch.Tensor:
    """The routed local experts' weighted SwiGLU sum, [T, H] in ``hidden_states``' dtype: one
    batch per local expert chosen by some token (its tokens gathered), the others untouched.
    ``topk_ids`` are global; ``w13[i]`` / ``w2[i]`` are expert ``expert_offset + i``."""
    num_tokens, top_k = topk_ids.shape
    num_local, intermediate = w13.shape[0], w2.shape[-1]
    out = hidden_states.new_zeros(num_tokens, hidden_states.shape[-1], dtype=torch.float32)
    flat_ids = topk_ids.flatten() - expert_offset  # [T * K]: (token, slot) pairs, token-major
    # Pairs routed to another rank's experts go to bucket ``num_local``, never computed.
    flat_ids = flat_ids.masked_fill((flat_ids < 0) | (flat_ids >= num_local), num_local)
    flat_weights = topk_weights.flatten()
    order = torch.argsort(flat_ids, stable=True)  # the pairs grouped by expert
    counts = torch.bincount(flat_ids, minlength=num_local + 1).tolist()
    start = 0
    for expert, count in enumerate(counts[:num_local]):
        if count == 0:
            continue
        pairs = order[start : start + count]
        start += count
        tokens = pairs // top_k
        x = hidden_states.index_select(0, tokens)  # [n, H]
        gate_up = F.linear(x, w13[expert])  # [n, 2I]
        act = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
        y = F.linear(act, w2[expert])  # [n, H]
        out.index_add_(0, tokens, y.float() * flat_weights[pairs, None])
    return out.to(hidden_states.dtype)


def fused_moe_reference(
    hidden_states: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    scoring_func: str,
    expert_offset: int = 0,
) -> torch.Tensor:
    """``select_experts`` then ``fused_experts_reference``: the op's reference, as a function."""
    weights, ids = select_experts(router_logits, top_k, renormalize, scoring_func)
    return fused_experts_reference(hidden_states, w13, w2, weights, ids, expert_offset)


_LIBRARY = torch.library.Library("kiln", "FRAGMENT")
_LIBRARY.define(
    "fused_moe(Tensor hidden_states, Tensor router_logits, Tensor w13, Tensor w2, int top_k, "
    "bool renormalize, str scoring_func, int expert_offset=0) -> Tensor"
)
_LIBRARY.impl("fused_moe", fused_moe_reference, "CompositeExplicitAutograd")


@torch.library.register_fake("kiln::fused_moe", lib=_LIBRARY)
def _fused_moe_fake(
    hidden_states: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    scoring_func: str,
    expert_offset: int = 0,
) -> torch.Tensor:
    return torch.empty_like(hidden_states)


@register_op("fused_moe")
class FusedMoE(CustomOp):
    """The routed experts of one MoE layer; see the module docstring for the op's contract.

    Args:
        num_experts: E, the routed experts.
        top_k: experts per token.
        hidden_size: H.
        intermediate_size: each expert's intermediate size (the whole model's; this rank holds
            ``intermediate_size / tp_size`` of it).
        renormalize: divide the chosen experts' weights by their sum.
        scoring_func: ``"softmax"`` or ``"sigmoid"``.
        params_dtype: the model's compute dtype.
        shared_experts: a dense MLP every token also goes through (its output is already summed
            over ranks), added to the routed experts' sum; None: none.
        prefix: the layer's name in the model.
        tp_size: the tensor-parallel size expected (None: the current group's).
        expert_parallel: split the experts whole over the tensor-parallel ranks instead of their
            intermediate size (None: ``parallel.enable_expert_parallel`` of the config the model
            is built in, ``kiln.config.set_current_config``; False outside one).

    Raises:
        ValueError: ``scoring_func`` or ``top_k`` out of range, ``intermediate_size`` (or with
            expert parallelism ``num_experts``) does not split over the ranks.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        renormalize: bool = True,
        scoring_func: str = "softmax",
        params_dtype: torch.dtype | None = None,
        shared_experts: nn.Module | None = None,
        prefix: str = "",
        tp_size: int | None = None,
        expert_parallel: bool | None = None,
    ) -> None:
        super().__init__()
        if scoring_func not in SCORING_FUNCS:
            raise ValueError(f"{prefix}: scoring_func={scoring_func!r}; allowed: {SCORING_FUNCS}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(
                f"{prefix}: top_k={top_k} (num_experts_per_tok); allowed: 1 to {num_experts}"
            )
        group = tp_group_for(tp_size)
        self.tp_group, self.tp_rank, self.tp_size = group, group.rank, group.world_size
        self.num_experts, self.top_k, self.hidden_size = num_experts, top_k, hidden_size
        self.renormalize, self.scoring_func, self.prefix = renormalize, scoring_func, prefix
        if expert_parallel is None:
            expert_parallel = expert_parallel_enabled()
        # Experts split whole over the ranks (expert parallelism), or each one's intermediate
        # size sliced (tensor parallelism); either way one all-reduce sums the ranks' parts.
        self.ep_size = self.tp_size if expert_parallel else 1
        self.ep_rank = self.tp_rank if expert_parallel else 0
        if num_experts % self.ep_size:
            raise ValueError(
                f"{prefix or 'moe'}: num_experts={num_experts} is not divisible by "
                f"parallel.tensor_parallel_size={self.tp_size} with "
                "parallel.enable_expert_parallel; allowed: a tensor_parallel_size that divides "
                f"{num_experts}, or enable_expert_parallel=False"
            )
        self.num_local_experts = num_experts // self.ep_size
        self.expert_offset = self.ep_rank * self.num_local_experts
        self.intermediate_size = divide(
            intermediate_size, self.tp_size // self.ep_size, f"{prefix or 'moe'} intermediate size"
        )
        dtype = params_dtype or torch.get_default_dtype()
        size, num_local = self.intermediate_size, self.num_local_experts
        self.w13_weight = nn.Parameter(
            torch.empty(num_local, 2 * size, hidden_size, dtype=dtype), requires_grad=False
        )
        self.w2_weight = nn.Parameter(
            torch.empty(num_local, hidden_size, size, dtype=dtype), requires_grad=False
        )
        for param in (self.w13_weight, self.w2_weight):
            set_weight_attrs(param, {"weight_loader": self.weight_loader})
        self.shared_experts = shared_experts

    def forward_native(
        self, hidden_states: torch.Tensor, router_logits: torch.Tensor
    ) -> torch.Tensor:
        """``hidden_states`` [T, H], ``router_logits`` [T, E] -> [T, H] (this rank's part)."""
        args = (self.top_k, self.renormalize, self.scoring_func, self.expert_offset)
        if is_capturing():
            return torch.ops.kiln.fused_moe(
                hidden_states, router_logits, self.w13_weight, self.w2_weight, *args
            )
        return fused_moe_reference(
            hidden_states, router_logits, self.w13_weight, self.w2_weight, *args
        )

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        # The dispatched op computes this rank's partial sum; the collective and the shared
        # experts stay here, so providers need not know about either.
        out = super().forward(hidden_states, router_logits)
        if self.tp_size > 1:  # the slices' or the experts' partial sums
            out = self.tp_group.all_reduce(out)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden_states)
        return out

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: Any = None
    ) -> None:
        """Copy one checkpoint tensor (this rank's slice of it) into ``param``.

        ``shard_id`` is ``(expert, part)``: see the module docstring. With expert parallelism
        another rank's expert is skipped (nothing copied) and a stacked tensor is narrowed to
        the local experts.

        Raises:
            ValueError: a malformed ``shard_id``, a part that belongs to the other parameter, or
                a tensor whose shape does not fit.
        """
        if not (isinstance(shard_id, tuple) and len(shard_id) == 2):
            raise ValueError(
                f"{self.prefix}: shard_id must be (expert or None, part); got {shard_id!r}"
            )
        expert, part = shard_id
        parts = W13_PARTS if param is self.w13_weight else W2_PARTS
        if part not in parts:
            raise ValueError(f"{self.prefix}: part {part!r} does not load here; allowed: {parts}")
        if expert is not None and not (isinstance(expert, int) and 0 <= expert < self.num_experts):
            raise ValueError(
                f"{self.prefix}: expert {expert!r} out of range(0, {self.num_experts})"
            )
        # Expert dimension first: [L, out, in] for a stacked tensor, [1, out, in] for one expert.
        if expert is None:
            weight = loaded_weight
            if self.ep_size > 1 and loaded_weight.shape[0] == self.num_experts:
                weight = weight.narrow(0, self.expert_offset, self.num_local_experts)
            target = param.data
        else:
            local = expert - self.expert_offset
            if not 0 <= local < self.num_local_experts:
                return  # another rank's expert
            weight, target = loaded_weight.unsqueeze(0), param.data[local : local + 1]
        num_slices = self.tp_size // self.ep_size  # ranks that share one expert
        size = self.intermediate_size
        start = 0 if self.ep_size > 1 else self.tp_rank * size
        if part == "down":  # [., H, I]: this rank's input columns
            pieces = [(weight, 2, target)]
        elif part == "gate_up":  # [., 2I, H]: gate rows then up rows, each sliced
            half = weight.shape[1] // 2
            pieces = [
                (weight[:, :half], 1, target[:, :size]),
                (weight[:, half:], 1, target[:, size:]),
            ]
        else:
            offset = 0 if part == "gate" else size
            pieces = [(weight, 1, target[:, offset : offset + size])]
        for source, dim, dest in pieces:
            if source.dim() != 3 or source.shape[dim] != size * num_slices:
                raise ValueError(
                    f"{self.prefix}: checkpoint tensor of shape {tuple(loaded_weight.shape)} "
                    f"({part}, expert {expert}) does not fit {tuple(param.shape)} "
                    f"over {self.tp_size} ranks"
                )
            source = source.narrow(dim, start, size) if num_slices > 1 else source
            if source.shape != dest.shape:
                raise ValueError(
                    f"{self.prefix}: checkpoint tensor of shape {tuple(loaded_weight.shape)} "
                    f"({part}, expert {expert}) does not fit {tuple(dest.shape)}"
                )
            dest.copy_(source)

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
            f"intermediate={self.intermediate_size}, scoring={self.scoring_func}, "
            f"renormalize={self.renormalize}"
            + (
                f", local_experts={self.expert_offset}..."
                f"{self.expert_offset + self.num_local_experts - 1}"
                if self.ep_size > 1
                else ""
            )
        )

    @classmethod
    def make_examples(cls, generator: torch.Generator) -> list[tuple[CustomOp, tuple, dict]]:
        examples: list[tuple[CustomOp, tuple, dict]] = []
        cases = [
            (8, 2, "softmax", True, torch.float32),
            (8, 2, "softmax", True, torch.bfloat16),
            (6, 1, "sigmoid", False, torch.float32),
            (4, 3, "sigmoid", True, torch.bfloat16),
        ]
        layers = [
            cls(e, k, 64, 48, renormalize=r, scoring_func=s, params_dtype=dtype)
            for e, k, s, r, dtype in cases
        ]
        # Rank 1 of 2 under expert parallelism: experts 4..7 of 8 (providers must honour
        # ``expert_offset`` or decline it in ``supports``). Only forward_native and providers
        # run on examples, never the layer's all-reduce: any object stands in for the
        # communicator.
        rank1 = TensorParallelGroup(rank=1, world_size=2, communicator=cast(Any, object()))
        with set_tp_group(rank1):
            layers.append(cls(8, 2, 64, 48, params_dtype=torch.float32, expert_parallel=True))
        for layer in layers:
            num_experts, dtype = layer.num_experts, layer.w13_weight.dtype
            for param in layer.parameters():
                param.data.copy_(0.1 * torch.randn(param.shape, generator=generator))
            for num_tokens in (1, 9):
                x = torch.randn(num_tokens, 64, generator=generator).to(dtype)
                logits = torch.randn(num_tokens, num_experts, generator=generator).to(dtype)
                examples.append((layer, (x, logits), {}))
        return examples


def expert_parallel_enabled() -> bool:
    """Whether the model being built (``kiln.config.set_current_config``) splits its experts
    over the ranks (``parallel.enable_expert_parallel``)."""
    from kiln.config import get_current_config

    config = get_current_config()
    return config is not None and config.parallel.enable_expert_parallel


def expert_shard(
    name: str, expert_names: dict[str, str]
) -> tuple[str, tuple[int | None, str]] | None:
    """Map a checkpoint name inside an ``experts`` module onto ``FusedMoE``'s parameters.

    ``expert_names`` maps the checkpoint's per-expert projection names to parts (Mixtral:
    ``{"w1": "gate", "w3": "up", "w2": "down"}``; Qwen: ``gate_proj``, ``up_proj``,
    ``down_proj``). Returns ``(parameter name, (expert, part))``, or None for a name outside an
    ``experts`` module: ``...experts.3.w1.weight`` -> ``(...experts.w13_weight, (3, "gate"))``;
    the stacked ``...experts.gate_up_proj`` / ``...experts.down_proj`` -> expert None.
    """
    parts = name.split(".")
    if "experts" not in parts:
        return None
    i = parts.index("experts")
    module, rest = ".".join(parts[: i + 1]), parts[i + 1 :]
    if rest in (["gate_up_proj"], ["down_proj"]):
        part = "gate_up" if rest[0] == "gate_up_proj" else "down"
        return f"{module}.{'w13' if part == 'gate_up' else 'w2'}_weight", (None, part)
    if len(rest) == 3 and rest[0].isdigit() and rest[1] in expert_names and rest[2] == "weight":
        part = expert_names[rest[1]]
        return f"{module}.{'w2' if part == 'down' else 'w13'}_weight", (int(rest[0]), part)
    return None


def shard_keys(shard_id: tuple[int | None, str], num_experts: int) -> set[tuple[int, str]]:
    """The ``(expert, gate|up|down)`` pieces a ``weight_loader`` call with ``shard_id`` fills."""
    expert, part = shard_id
    experts = range(num_experts) if expert is None else (expert,)
    pieces = ("gate", "up") if part == "gate_up" else (part,)
    return {(e, p) for e in experts for p in pieces}


__all__ = [
    "SCORING_FUNCS",
    "FusedMoE",
    "expert_parallel_enabled",
    "expert_shard",
    "fused_experts_reference",
    "fused_moe_reference",
    "select_experts",
    "shard_keys",
]
