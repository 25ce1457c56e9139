"""Executors: how the engine core reaches its workers.

``Executor`` is the seam: the engine core calls typed methods on it, never a worker directly.
``UniProcExecutor`` runs one worker in the engine core's own process; ``MultiprocExecutor`` one
process per rank on this machine; ``RayExecutor`` one Ray actor per rank, on a Ray cluster of one
machine or many.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from kiln.config import KilnConfig
from kiln.messages import ModelRunnerOutput, SchedulerOutput


class WorkerDiedError(RuntimeError):
    """A worker process exited while the executor needed it."""


class Executor(ABC):
    def __init__(self, config: KilnConfig) -> None:
        self.config = config

    @staticmethod
    def get_class(config: KilnConfig) -> type[Executor]:
        """The executor class for ``parallel.distributed_executor_backend``; None (the default)
        means "uni" for one rank and "mp" for more (one machine; "ray" only when asked).

        Raises:
            NotImplementedError: a backend that is not built.
        """
        backend = config.parallel.distributed_executor_backend
        if backend is None:
            backend = "uni" if config.parallel.world_size == 1 else "mp"
        if backend == "uni":
            from kiln.executor.uniproc import UniProcExecutor

            return UniProcExecutor
        if backend == "mp":
            from kiln.executor.multiproc import MultiprocExecutor

            return MultiprocExecutor
        if backend == "ray":
            from kiln.executor.ray_executor import RayExecutor

            return RayExecutor
        raise NotImplementedError(
            f"parallel.distributed_executor_backend={backend!r} is not built; allowed: 'uni', "
            "'mp', 'ray'"
        )

    def check_health(self) -> None:
        """Raise if a worker has died (called by an idle engine core when a sentinel fires).

        Raises:
            WorkerDiedError: a worker process exited.
        """
        return None  # the uniproc worker lives (and dies) with the engine core

    def sentinels(self) -> list[int]:
        """File descriptors that become readable when a worker process exits (empty: the
        workers live in this process)."""
        return []

    @abstractmethod
    def initialize(self) -> None:
        """Start the workers: device init and model load on every rank."""

    @abstractmethod
    def determine_available_memory(self) -> list[int]:
        """Bytes each rank can give the KV cache."""

    @abstractmethod
    def get_kv_cache_bytes_per_block(self) -> int: ...

    @abstractmethod
    def get_max_model_len(self) -> int: ...

    @abstractmethod
    def initialize_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` KV-cache blocks on every rank and warm the model up."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    @abstractmethod
    def shutdown(self) -> None: ...


class MultiRankExecutor(Executor):
    """An executor whose workers live in other processes (mp) or actors (Ray): every lifecycle
    call is ``_call(method, *args)`` on all ranks; subclasses say how a call reaches them."""

    @abstractmethod
    def _call(self, method: str, *args: Any) -> list[Any]:
        """Run ``method(*args)`` on every rank; their answers in rank order."""

    def determine_available_memory(self) -> list[int]:
        return self._call("determine_available_memory")

    def get_kv_cache_bytes_per_block(self) -> int:
        return self._call("get_kv_cache_bytes_per_block")[0]

    def get_max_model_len(self) -> int:
        return self._call("get_max_model_len")[0]

    def initialize_cache(self, num_blocks: int) -> None:
        self._call("initialize_cache", num_blocks)
        self._call("compile_or_warm_up_model")
