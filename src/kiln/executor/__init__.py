"""Executors: how the engine core reaches its workers.

``Executor`` is the seam: the engine core calls typed methods on it, never a worker directly.
``UniProcExecutor`` runs one worker in the engine core's own process; ``MultiprocExecutor`` one
process per rank on this machine; ``RayExecutor`` one Ray actor per rank, on a Ray cluster of one
machine or many.

Batches in flight: with a pipeline of ``N`` stages, ``max_concurrent_batches`` is ``N`` and the
engine core hands the executor a new batch (``execute_model_async``) while earlier ones are still
in the pipeline. Every rank runs the batches in the order they were handed over, and their
outputs come back in that order.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from kiln.config import KilnConfig
from kiln.messages import ModelRunnerOutput, SchedulerOutput


class WorkerDiedError(RuntimeError):
    """A worker process exited while the executor needed it."""


class ModelOutputFuture(ABC):
    """A batch's ``ModelRunnerOutput`` on its way back from the workers."""

    @abstractmethod
    def done(self) -> bool:
        """Whether ``result()`` would return at once (never waits)."""

    @abstractmethod
    def result(self) -> ModelRunnerOutput:
        """The output, once the workers have run the batch.

        Raises:
            WorkerDiedError: a worker exited.
            RuntimeError: a worker raised.
        """


class DoneOutput(ModelOutputFuture):
    """An output that is already here."""

    def __init__(self, output: ModelRunnerOutput) -> None:
        self.output = output

    def done(self) -> bool:
        return True

    def result(self) -> ModelRunnerOutput:
        return self.output


class Executor(ABC):
    def __init__(self, config: KilnConfig) -> None:
        self.config = config

    @property
    def max_concurrent_batches(self) -> int:
        """How many batches the engine core may have in flight (1: one step at a time)."""
        return 1

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> ModelOutputFuture:
        """Hand the workers a batch and return without waiting for its output (workers run
        batches, and outputs come back, in the order they were handed over)."""
        return DoneOutput(self.execute_model(scheduler_output))

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

    @property
    def max_concurrent_batches(self) -> int:
        """A pipeline's stages each run a different batch at once: one batch per stage."""
        return self.config.parallel.pipeline_parallel_size

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
