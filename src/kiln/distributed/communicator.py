"""Device communicators: the collectives tensor parallelism needs and the point-to-point
transfers pipeline parallelism needs, per platform.

A platform names its communicator class (``communicator_cls``); each rank instantiates it once per
group it belongs to (its tensor-parallel group, or its pipeline). Ranks are the group's: ``0`` to
``world_size - 1``. A group is the whole process group unless both kinds of parallelism are on:
then each is a sub-group, and the communicator is made with the keyword ``ranks`` (the group's
ranks in the process group, in group order). Taking ``ranks`` is optional: a communicator without
it serves tensor or pipeline parallelism alone, and combining them is refused. The reference
implementation uses ``torch.distributed`` with the platform's ``dist_backend`` and is the
identity when the group has one rank, so a single-device engine needs no process group at all.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


class Communicator(ABC):
    """Collectives over the ranks of one model replica."""

    @abstractmethod
    def __init__(self, rank: int, world_size: int, device: torch.device) -> None:
        """This rank's communicator in a group of ``world_size``. An implementation may also
        take ``ranks: Sequence[int] | None = None`` (see the module docstring)."""

    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The element-wise sum over ranks."""

    @abstractmethod
    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along ``dim`` in rank order."""

    @abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``src``'s ``tensor`` on every rank."""

    @abstractmethod
    def barrier(self) -> None: ...

    @abstractmethod
    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Send ``tensor`` to rank ``dst``, which receives it with ``recv``."""

    @abstractmethod
    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Fill ``tensor`` (allocated by the caller with the sent shape and dtype) with what rank
        ``src`` sent; return it."""


class TorchDistCommunicator(Communicator):
    """``torch.distributed`` collectives; the identity for a single rank."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        device: torch.device,
        ranks: Sequence[int] | None = None,
    ) -> None:
        """``ranks``: the group's ranks in the process group (None: all of them, in order); a
        sub-group gets its own ``torch.distributed`` group, made by its members only."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} is invalid for world_size={world_size}")
        self.rank, self.world_size, self.device = rank, world_size, device
        self.ranks = list(range(world_size)) if ranks is None else list(ranks)
        if len(self.ranks) != world_size:
            raise ValueError(f"ranks={ranks!r} is invalid; allowed: {world_size} process ranks")
        self.group: Any = None
        """The ``torch.distributed`` group of ``ranks`` (None: the default, whole group)."""
        if world_size > 1 and not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed must be initialised before a communicator with "
                f"world_size={world_size}"
            )
        if world_size > 1 and ranks is not None:
            self.group = dist.new_group(self.ranks, use_local_synchronization=True)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor, group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.world_size > 1:
            dist.broadcast(tensor, self.ranks[src], group=self.group)
        return tensor

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        dist.send(tensor.contiguous(), self.ranks[dst])

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        dist.recv(tensor, self.ranks[src])
        return tensor
