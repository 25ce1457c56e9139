"""Executors: how the engine core reaches its workers.

``Executor`` is the seam: the engine core calls typed methods on it, never a worker directly.
``UniProcExecutor`` runs one worker in the engine core's own process; ``MultiprocExecutor`` one
process per rank on this machine; ``RayExecutor`` one Ray actor per rank, on a Ray cluster of one
machine or many.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from kiln.config import KilnConfig
from kiln.messages import ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    def __init__(self, config: KilnConfig) -> None:
        self.config = config

    @staticmethod
    def get_class(config: KilnConfig) -> type[Executor]:
        """The executor class for ``parallel.distributed_executor_backend``.

        "uni" with more than one rank (``world_size``) means "mp" (uni is the default backend;
        one process cannot hold several ranks).

        Raises:
            NotImplementedError: a backend that is not built.
        """
        backend = config.parallel.distributed_executor_backend
        if backend == "uni" and config.parallel.world_size > 1:
            backend = "mp"
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
            f"parallel.distributed_executor_backend={backend!r} is not built yet; use 'uni' or 'mp'"
        )

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
