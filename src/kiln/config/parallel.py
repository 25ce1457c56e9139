"""``ParallelConfig``: how the model is split over devices, processes and engine cores."""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.config.checks import check

EXECUTOR_BACKENDS = ("uni", "mp", "ray")
"""Values of ``parallel.distributed_executor_backend``."""


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split over devices and processes."""

    tensor_parallel_size: int = field(default=1, metadata={"aliases": ("-tp",)})
    """Devices one copy of the model is split over."""
    pipeline_parallel_size: int = field(default=1, metadata={"aliases": ("-pp",)})
    """Stages one copy of the model's layers is split over, one rank each, run in turn (the
    first embeds, the last samples); each stage is split over ``tensor_parallel_size`` ranks."""
    enable_expert_parallel: bool = False
    """Split each MoE layer's routed experts over the ``tensor_parallel_size`` ranks, whole
    (rank r holds experts ``[r * E / N, (r + 1) * E / N)``) instead of slicing every expert's
    intermediate size; the router and attention stay as under tensor parallelism. The number of
    experts must be divisible by ``tensor_parallel_size``; with one rank it changes nothing."""
    ray_address: str | None = None
    """The Ray cluster of the ray backend (its head's host:port, or "auto"); None: the
    ``RAY_ADDRESS`` environment variable, else a local cluster Kiln starts and stops."""
    data_parallel_size: int = field(default=1, metadata={"aliases": ("-dp",)})
    """Engine cores, each with its own copy of the model (its ranks), scheduler and KV cache,
    behind one API server; each request goes to the engine with the fewest unfinished requests.
    The cores (and the KV-cache memory) are split between them."""
    distributed_executor_backend: str | None = field(
        default=None, metadata={"choices": EXECUTOR_BACKENDS}
    )
    """uni (the worker in the engine core), mp (a process per rank) or ray (many machines); None:
    uni for one rank, mp for more."""
    data_parallel_rank: int = field(default=0, metadata={"internal": True})
    """This engine core's index among the ``data_parallel_size`` (set by the front end that starts
    the engines; not a flag)."""
    rank: int = field(default=0, metadata={"internal": True})
    """This worker's rank among its engine's ``world_size`` ranks (set by the executor; not a
    flag)."""

    @property
    def world_size(self) -> int:
        """Ranks (worker processes) of one engine core."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def __post_init__(self) -> None:
        check(
            self.tensor_parallel_size >= 1,
            "parallel.tensor_parallel_size",
            self.tensor_parallel_size,
            "an integer >= 1",
        )
        check(
            self.pipeline_parallel_size >= 1,
            "parallel.pipeline_parallel_size",
            self.pipeline_parallel_size,
            "an integer >= 1",
        )
        check(
            self.data_parallel_size >= 1,
            "parallel.data_parallel_size",
            self.data_parallel_size,
            "an integer >= 1",
        )
        check(
            self.distributed_executor_backend is None
            or self.distributed_executor_backend in EXECUTOR_BACKENDS,
            "parallel.distributed_executor_backend",
            self.distributed_executor_backend,
            f"None or one of {list(EXECUTOR_BACKENDS)}",
        )
        check(
            self.distributed_executor_backend != "uni" or self.world_size == 1,
            "parallel.distributed_executor_backend",
            self.distributed_executor_backend,
            f"'mp' or 'ray' (or None) with {self.world_size} ranks: one process holds one rank",
        )
        check(
            0 <= self.data_parallel_rank < self.data_parallel_size,
            "parallel.data_parallel_rank",
            self.data_parallel_rank,
            f"0..{self.data_parallel_size - 1}",
        )
        check(
            0 <= self.rank < self.world_size,
            "parallel.rank",
            self.rank,
            f"0..{self.world_size - 1}",
        )
