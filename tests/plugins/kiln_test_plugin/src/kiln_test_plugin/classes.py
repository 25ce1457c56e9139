"""Classes the test platform names: Kiln's own worker, runner and scheduler under the plugin's
names (so the platform really runs models), and communicators that fail the interface check on
purpose."""

from __future__ import annotations

import os
from typing import Any

import torch

from kiln.config import KilnConfig
from kiln.distributed.communicator import TorchDistCommunicator
from kiln.model_executor.layers.attention import CommonAttentionMetadata
from kiln.model_executor.layers.attention.backends.cpu import (
    CPUAttentionBackend,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
    CPUPrefill,
)
from kiln.scheduler.scheduler import Scheduler
from kiln.worker.graph import EagerGraphWrapper
from kiln.worker.model_runner import ModelRunner
from kiln.worker.worker import Worker
from kiln.worker.worker_base import ModelRunnerBase


class TestModelRunner(ModelRunner):
    """Kiln's model runner under the plugin's own name (a real platform would specialise it)."""


class InterfaceOnlyModelRunner(ModelRunnerBase):
    """A runner with exactly ``ModelRunnerBase``'s members (delegating to Kiln's): the worker
    must need nothing more."""

    def __init__(self, config: KilnConfig, device: torch.device) -> None:
        self._runner = ModelRunner(config, device)

    def load_model(self) -> None:
        self._runner.load_model()

    def get_kv_cache_bytes_per_block(self) -> int:
        return self._runner.get_kv_cache_bytes_per_block()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._runner.initialize_kv_cache(num_blocks)

    def get_max_model_len(self) -> int:
        return self._runner.get_max_model_len()

    def dummy_run(self, num_tokens: int) -> None:
        self._runner.dummy_run(num_tokens)

    def capture_model(self) -> list[int]:
        return self._runner.capture_model()

    def execute_model(self, scheduler_output: Any) -> Any:
        return self._runner.execute_model(scheduler_output)


class TestWorker(Worker):
    """Kiln's worker, counting the steps it runs."""

    steps = 0

    def execute_model(self, scheduler_output: Any) -> Any:
        type(self).steps += 1
        return super().execute_model(scheduler_output)


class TestScheduler(Scheduler):
    """Kiln's scheduler under the plugin's own name."""


class LoggingCommunicator(TorchDistCommunicator):
    """Kiln's ``torch.distributed`` communicator under the plugin's name. With
    ``KILN_TEST_COMMUNICATOR_LOG`` set, each rank appends ``"<rank> <method>"`` to that file the
    first time it runs each collective: a test sees that the model's collectives come here.
    (The duck-typed variants below fail the interface check on purpose.)"""

    def __init__(self, rank: int, world_size: int, device: torch.device, ranks: Any = None) -> None:
        super().__init__(rank, world_size, device, ranks)
        self.logged: set[str] = set()

    def _log(self, method: str) -> None:
        path = os.environ.get("KILN_TEST_COMMUNICATOR_LOG")
        if path and method not in self.logged:
            self.logged.add(method)
            with open(path, "a") as f:
                f.write(f"{self.rank} {method}\n")

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self._log("all_reduce")
        return super().all_reduce(tensor)

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        self._log("all_gather")
        return super().all_gather(tensor, dim)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self._log("send")
        super().send(tensor, dst)

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        self._log("recv")
        return super().recv(tensor, src)


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


class DuckTypedAttentionBackend:
    """Kiln's CPU attention backend's methods without subclassing ``AttentionBackend``: refused,
    since attention backends must subclass it."""

    get_name = staticmethod(CPUAttentionBackend.get_name)
    get_impl_cls = staticmethod(CPUAttentionBackend.get_impl_cls)
    get_metadata_builder_cls = staticmethod(CPUAttentionBackend.get_metadata_builder_cls)
    get_kv_cache_shape = staticmethod(CPUAttentionBackend.get_kv_cache_shape)


class ChunkBlindMetadataBuilder(CPUAttentionMetadataBuilder):
    """Right for a prompt computed in one step, wrong for a later prefill chunk or a prefix-cache
    hit: such a chunk attends only to its own new tokens, not to the context already cached."""

    def build(self, common: CommonAttentionMetadata) -> CPUAttentionMetadata:
        metadata = super().build(common)
        metadata.prefills = [
            CPUPrefill(p.token_start, p.token_end, 0, p.token_end - p.token_start, None, None)
            for p in metadata.prefills
        ]
        return metadata


class ChunkBlindAttentionBackend(CPUAttentionBackend):
    """The CPU backend with ``ChunkBlindMetadataBuilder``: passes a greedy check whose prompts
    fit one step and miss the prefix cache, fails one with a small token budget."""

    @staticmethod
    def get_metadata_builder_cls() -> type[CPUAttentionMetadataBuilder]:
        return ChunkBlindMetadataBuilder


class CountingGraphWrapper(EagerGraphWrapper):
    calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        type(self).calls += 1
        return super().__call__(*args, **kwargs)
