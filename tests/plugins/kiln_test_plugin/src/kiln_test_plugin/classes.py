"""Classes the test platform names. They implement Kiln's interfaces just enough to be resolved
and checked; they are fixtures for the plugin system, not an engine."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from kiln.config import KilnConfig
from kiln.core.sched.interface import SchedulerInterface
from kiln.distributed.communicator import TorchDistCommunicator
from kiln.worker.graph import EagerGraphWrapper
from kiln.worker.worker_base import ModelRunnerBase, WorkerBase


class TestModelRunner(ModelRunnerBase):
    def __init__(self, config: KilnConfig, device: torch.device) -> None:
        self.config, self.device = config, device

    def load_model(self) -> None:
        raise NotImplementedError("the test platform runs no model")

    def get_kv_cache_bytes_per_block(self) -> int:
        return 0

    def initialize_kv_cache(self, num_blocks: int) -> None:
        raise NotImplementedError("the test platform runs no model")

    def execute_model(self, scheduler_output: Any) -> Any:
        raise NotImplementedError("the test platform runs no model")


class TestWorker(WorkerBase):
    def __init__(
        self, config: KilnConfig, local_rank: int, rank: int, distributed_init_method: str
    ) -> None:
        self.config = config

    def init_device(self) -> None: ...

    def load_model(self) -> None:
        raise NotImplementedError("the test platform runs no model")

    def determine_available_memory(self) -> int:
        return 0

    def get_kv_cache_bytes_per_block(self) -> int:
        return 0

    def get_max_model_len(self) -> int:
        return 0

    def initialize_cache(self, num_blocks: int) -> None: ...

    def compile_or_warm_up_model(self) -> None: ...

    def execute_model(self, scheduler_output: Any) -> Any:
        raise NotImplementedError("the test platform runs no model")

    def shutdown(self) -> None: ...


class TestScheduler(SchedulerInterface):
    def __init__(self, config: KilnConfig, num_blocks: int) -> None:
        self.requests: list[Any] = []

    def add_request(self, request: Any) -> None:
        self.requests.append(request)

    def schedule(self) -> Any:
        return None

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        return {}

    def finish_requests(self, request_ids: Iterable[str], finished_status: Any) -> None: ...

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)


class LoggingCommunicator(TorchDistCommunicator):
    """Duck-typed variants below fail the interface check on purpose."""


class CommunicatorMissingMethod:
    def __init__(self, rank: int, world_size: int, device: torch.device) -> None: ...

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        return tensor

    # no barrier()


class CommunicatorWrongSignature(CommunicatorMissingMethod):
    def all_reduce(self, tensor: torch.Tensor, group: Any) -> torch.Tensor:  # extra required arg
        return tensor

    def barrier(self) -> None: ...


class CountingGraphWrapper(EagerGraphWrapper):
    calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        type(self).calls += 1
        return super().__call__(*args, **kwargs)
