"""The tensor-parallel group a model is built in: this rank's index, the number of ranks, and the
platform's communicator that carries their collectives.

Contract: a worker joins its group (``init_distributed``) and builds its model inside
``with set_tp_group(group)``; each parallel layer reads ``get_tp_group()`` once, in its
constructor, and keeps the group for its forward passes. Outside such a block the group is the
single-rank one (rank 0 of 1, no communicator), so a model built in a test or by a uniproc worker
needs nothing. This module knows nothing about models, executors or processes.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

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

_tp_group: contextvars.ContextVar[TensorParallelGroup] = contextvars.ContextVar(
    "kiln_tp_group", default=SINGLE_RANK
)


@contextlib.contextmanager
def set_tp_group(group: TensorParallelGroup) -> Iterator[TensorParallelGroup]:
    """Make ``group`` what ``get_tp_group()`` returns inside the block (model construction)."""
    token = _tp_group.set(group)
    try:
        yield group
    finally:
        _tp_group.reset(token)


def get_tp_group() -> TensorParallelGroup:
    """The group set by the enclosing ``set_tp_group`` block; the single-rank group outside one."""
    return _tp_group.get()


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
    """Join the process group of ``parallel.tensor_parallel_size`` ranks and instantiate the
    platform's communicator (``device.communicator_cls``) for this rank.

    With one rank no process group is made. Side effect: ``torch.distributed`` is initialised in
    this process (undo with ``destroy_distributed``).

    Raises:
        ValueError: ``rank`` outside the group.
        InterfaceError: the communicator class does not implement ``Communicator``.
    """
    import torch.distributed as dist

    from kiln.plugins.interfaces import resolve_class

    world_size = config.parallel.tensor_parallel_size
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
    communicator_cls = resolve_class("communicator_cls", config.device.communicator_cls)
    return TensorParallelGroup(rank, world_size, communicator_cls(rank, world_size, device))


def destroy_distributed() -> None:
    """Leave the process group, if this process joined one."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def prepare_tensor_parallel_config(config: KilnConfig) -> KilnConfig:
    """The config the ranks of a tensor-parallel model load with: dense weights, no graphs.

    Quantized storage (GGUF blocks, int8/int4 kept by a platform's ``quant_config``) is not
    sharded: a GGUF row splits into blocks of 32 or 256 along the input dimension, which a
    row-parallel slice need not respect, and a platform's repacked layout is its own. So
    ``model.quantization`` auto means dense weights here, and an explicit method is refused.

    Raises:
        ValueError: ``model.quantization`` gguf, int8 or int4 with more than one rank.
    """
    tp_size = config.parallel.tensor_parallel_size
    method = config.model.quantization or "auto"
    if tp_size == 1:
        return config
    if method not in ("auto", "none"):
        raise ValueError(
            f"model.quantization={method!r} keeps weights quantized, which tensor parallelism "
            f"does not shard; with parallel.tensor_parallel_size={tp_size} allowed: 'auto' or "
            "'none' (--quantization none, dense weights)"
        )
    config = config.replace(model__quantization="none")
    if config.device.graph_capture_sizes is None:
        # NOTE: collectives through torch.distributed are not captured by the graph wrappers;
        # eager steps until a platform's communicator says it can be captured.
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
    "TensorParallelGroup",
    "destroy_distributed",
    "divide",
    "get_tp_group",
    "init_distributed",
    "prepare_tensor_parallel_config",
    "set_tp_group",
    "tp_group_for",
]
