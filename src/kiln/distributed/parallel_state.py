"""The groups a model is built in: the tensor-parallel group (ranks that split every layer) and
the pipeline (stages that each hold a slice of the layers), each with this rank's index, the
number of ranks, and the platform's communicator that carries their traffic.

Contract: a worker joins the process group (``init_distributed``, which also returns its
tensor-parallel group), makes its pipeline group (``init_pipeline_group``), and builds its model
inside ``with set_tp_group(tp), set_pp_group(pp)``; each parallel layer reads ``get_tp_group()``
once, in its constructor, and a model reads ``get_pp_group()`` once to build only its stage's
layers; both keep their group for the forward passes. Outside such a block the groups are the
single-rank ones (rank 0 of 1, no communicator), so a model built in a test or by a uniproc worker
needs nothing. Global ranks: ``rank = pp_rank * tensor_parallel_size + tp_rank``. This module knows
nothing about models, executors or processes.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kiln.config import KilnConfig
    from kiln.distributed.communicator import Communicator

DIST_INIT_TIMEOUT_S = 120
"""How long a rank waits for the others to join the process group, and for any one collective
(a peer that died mid-step otherwise leaves the survivors blocked for torch's default 30 min)."""


@dataclass(frozen=True)
class TensorParallelGroup:
    """This rank's place among the ranks that split one copy of the model."""

    rank: int = 0
    world_size: int = 1
    communicator: Communicator | None = None
    """None only for the single-rank group."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank={self.rank} is invalid for world_size={self.world_size}")
        if self.world_size > 1 and self.communicator is None:
            raise ValueError(f"a group of world_size={self.world_size} needs a communicator")

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over ranks (in place where the communicator can); identity for one rank."""
        if self.communicator is None:
            return tensor
        return self.communicator.all_reduce(tensor)

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along ``dim`` in rank order."""
        if self.communicator is None:
            return tensor
        return self.communicator.all_gather(tensor, dim)


SINGLE_RANK = TensorParallelGroup()


@dataclass(frozen=True)
class PipelineParallelGroup:
    """This rank's stage among the stages that run one copy of the model's layers in turn: the
    first embeds the tokens, each sends its last layer's hidden states and residual to the next,
    and the last applies the final norm and the LM head and samples."""

    rank: int = 0
    """The stage's index."""
    world_size: int = 1
    communicator: Communicator | None = None
    """None only for the single-stage pipeline."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank={self.rank} is invalid for world_size={self.world_size}")
        if self.world_size > 1 and self.communicator is None:
            raise ValueError(f"a pipeline of world_size={self.world_size} needs a communicator")

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.world_size - 1

    def layer_range(self, num_layers: int) -> tuple[int, int]:
        """``(start, end)``: the decoder layers this stage holds. Layers split as evenly as they
        go; the first ``num_layers % world_size`` stages hold one more.

        Raises:
            ValueError: fewer layers than stages.
        """
        if num_layers < self.world_size:
            raise ValueError(
                f"parallel.pipeline_parallel_size={self.world_size} exceeds the model's "
                f"{num_layers} layers; allowed: 1..{num_layers}"
            )
        size, extra = divmod(num_layers, self.world_size)
        start = self.rank * size + min(self.rank, extra)
        return start, start + size + (self.rank < extra)

    def send_to_next(self, tensor: torch.Tensor) -> None:
        """Hand ``tensor`` to the next stage (which calls ``recv_from_prev``)."""
        assert self.communicator is not None and not self.is_last
        self.communicator.send(tensor, self.rank + 1)

    def recv_from_prev(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` filled with what the previous stage sent."""
        assert self.communicator is not None and not self.is_first
        return self.communicator.recv(tensor, self.rank - 1)


SINGLE_STAGE = PipelineParallelGroup()

_tp_group: contextvars.ContextVar[TensorParallelGroup] = contextvars.ContextVar(
    "kiln_tp_group", default=SINGLE_RANK
)


@contextlib.contextmanager
def _scoped(var: contextvars.ContextVar[Any], value: Any) -> Iterator[Any]:
    """``var`` set to ``value`` inside the block, restored after it."""
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)


def set_tp_group(group: TensorParallelGroup) -> contextlib.AbstractContextManager:
    """Make ``group`` what ``get_tp_group()`` returns inside the block (model construction)."""
    return _scoped(_tp_group, group)


def get_tp_group() -> TensorParallelGroup:
    """The group set by the enclosing ``set_tp_group`` block; the single-rank group outside one."""
    return _tp_group.get()


_pp_group: contextvars.ContextVar[PipelineParallelGroup] = contextvars.ContextVar(
    "kiln_pp_group", default=SINGLE_STAGE
)


def set_pp_group(group: PipelineParallelGroup) -> contextlib.AbstractContextManager:
    """Make ``group`` what ``get_pp_group()`` returns inside the block (model construction)."""
    return _scoped(_pp_group, group)


def get_pp_group() -> PipelineParallelGroup:
    """The pipeline set by the enclosing ``set_pp_group`` block; one stage outside one."""
    return _pp_group.get()


def tp_group_for(tp_size: int | None) -> TensorParallelGroup:
    """The group a parallel layer is built in: the current one (``get_tp_group``), whose size
    ``tp_size`` (the layer's argument, None: any) must match.

    Raises:
        ValueError: ``tp_size`` given and different from the current group's size.
    """
    group = get_tp_group()
    if tp_size is not None and tp_size != group.world_size:
        raise ValueError(
            f"tp_size={tp_size} differs from the tensor-parallel group the layer is built in "
            f"(world_size={group.world_size}); allowed: None or {group.world_size}"
        )
    return group


def init_distributed(
    config: KilnConfig,
    rank: int,
    distributed_init_method: str,
    device: torch.device,
    dist_backend: str,
) -> TensorParallelGroup:
    """Join the process group of ``parallel.world_size`` ranks and instantiate the platform's
    communicator (``device.communicator_cls``) for this rank's tensor-parallel group.

    With one rank no process group is made. Side effect: ``torch.distributed`` is initialised in
    this process (undo with ``destroy_distributed``).

    Raises:
        ValueError: ``rank`` outside the group.
        InterfaceError: the communicator class does not implement ``Communicator``.
    """
    import torch.distributed as dist

    world_size = config.parallel.world_size
    if world_size == 1:
        return SINGLE_RANK
    if not dist.is_initialized():
        dist.init_process_group(
            backend=dist_backend,
            init_method=distributed_init_method,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=DIST_INIT_TIMEOUT_S),
        )
    tp_size = config.parallel.tensor_parallel_size
    if tp_size == 1:
        return SINGLE_RANK
    # This stage's ranks: consecutive global ranks.
    stage = rank // tp_size
    ranks = [stage * tp_size + i for i in range(tp_size)]
    communicator = _communicator(config, ranks.index(rank), ranks, device)
    return TensorParallelGroup(ranks.index(rank), tp_size, communicator)


def init_pipeline_group(
    config: KilnConfig, rank: int, device: torch.device
) -> PipelineParallelGroup:
    """This rank's stage of ``parallel.pipeline_parallel_size``, with the platform's communicator
    for it (the process group must be joined: ``init_distributed``). One stage: no communicator.

    Raises:
        InterfaceError: the communicator class does not implement ``Communicator``.
    """

    pp_size = config.parallel.pipeline_parallel_size
    if pp_size == 1:
        return SINGLE_STAGE
    # Each tensor-parallel rank hands its copy of the hidden states to the same rank of the
    # next stage: this rank's pipeline is every stage's rank at its tensor-parallel index.
    tp_size = config.parallel.tensor_parallel_size
    ranks = [stage * tp_size + rank % tp_size for stage in range(pp_size)]
    stage = rank // tp_size
    return PipelineParallelGroup(stage, pp_size, _communicator(config, stage, ranks, device))


def _communicator(
    config: KilnConfig, group_rank: int, ranks: list[int], device: torch.device
) -> Communicator:
    """The platform's communicator for the group of ``ranks`` (global ranks, in group order);
    given ``ranks`` only when the group is a sub-group of the process group.

    Raises:
        InterfaceError: the communicator class does not implement ``Communicator``.
        ValueError: a sub-group, and a communicator class that takes no ``ranks``.
    """
    from kiln.plugins.interfaces import resolve_class

    communicator_cls = resolve_class("communicator_cls", config.device.communicator_cls)
    if len(ranks) == config.parallel.world_size:
        return communicator_cls(group_rank, len(ranks), device)
    if "ranks" not in inspect.signature(communicator_cls).parameters:
        parallel = config.parallel
        raise ValueError(
            f"parallel.pipeline_parallel_size={parallel.pipeline_parallel_size} with "
            f"tensor_parallel_size={parallel.tensor_parallel_size} needs a communicator that "
            f"takes a sub-group (the keyword 'ranks'), which {config.device.communicator_cls} "
            "does not; allowed: one of the two sizes 1"
        )
    return communicator_cls(group_rank, len(ranks), device, ranks=ranks)


def output_rank(config: KilnConfig) -> int:
    """The rank whose ``execute_model`` answer is the step's output: the first tensor-parallel
    rank of the last pipeline stage (rank 0 without a pipeline)."""
    parallel = config.parallel
    return parallel.world_size - parallel.tensor_parallel_size


def destroy_distributed() -> None:
    """Leave the process group, if this process joined one."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def prepare_tensor_parallel_config(config: KilnConfig) -> KilnConfig:
    """The config the ranks of a tensor- or pipeline-parallel model load with: dense weights, no
    graphs.

    Quantized storage (GGUF blocks, int8/int4 kept by a platform's ``quant_config``) is not
    sharded: a GGUF row splits into blocks of 32 or 256 along the input dimension, which a
    row-parallel slice need not respect, and a platform's repacked layout is its own. Pipeline
    stages keep whole layers, but a last stage whose LM head is tied to the embedding would
    need the embedding's blocks as its head, which no quantization method builds yet. So
    ``model.quantization`` auto means dense weights with more than one rank, and an explicit
    method is refused; the same for a draft model's ``speculative.quantization`` (the draft is
    built in the ranks' group, sharded as the target).

    Raises:
        ValueError: ``model.quantization`` or ``speculative.quantization`` gguf, int8 or int4
            with more than one rank.
    """
    parallel = config.parallel
    if parallel.world_size == 1:
        return config
    # Each field's value, and how to ask for dense weights there.
    fields = {"model.quantization": (config.model.quantization, "--quantization none")}
    if config.speculative.method == "draft_model":
        fields["speculative.quantization"] = (
            config.speculative.quantization,
            '"quantization": "none" in --speculative-config',
        )
    for name, (method, dense) in fields.items():
        if method not in (None, "auto", "none"):
            raise ValueError(
                f"{name}={method!r} keeps weights quantized, which tensor and pipeline "
                f"parallelism do not split; with parallel.tensor_parallel_size="
                f"{parallel.tensor_parallel_size} and pipeline_parallel_size="
                f"{parallel.pipeline_parallel_size} allowed: 'auto' or 'none' ({dense}, dense "
                "weights)"
            )
    config = config.replace(model__quantization="none")
    if config.speculative.method == "draft_model":
        config = config.replace(speculative__quantization="none")
    if config.device.graph_capture_sizes is None:
        # NOTE: collectives and transfers through torch.distributed are not captured by the
        # graph wrappers; eager steps until a platform's communicator says it can be captured.
        config = config.replace(device__graph_capture_sizes=())
    return config


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator / denominator``, which must be exact.

    Raises:
        ValueError: ``what`` (e.g. "num_attention_heads") does not split over the ranks.
    """
    if numerator % denominator:
        raise ValueError(
            f"{what}={numerator} is not divisible by parallel.tensor_parallel_size={denominator}; "
            f"allowed: a tensor_parallel_size that divides {numerator}"
        )
    return numerator // denominator


__all__ = [
    "DIST_INIT_TIMEOUT_S",
    "SINGLE_RANK",
    "SINGLE_STAGE",
    "PipelineParallelGroup",
    "TensorParallelGroup",
    "destroy_distributed",
    "divide",
    "get_pp_group",
    "get_tp_group",
    "init_distributed",
    "init_pipeline_group",
    "output_rank",
    "prepare_tensor_parallel_config",
    "set_pp_group",
    "set_tp_group",
    "tp_group_for",
]
