"""Classes the test platform names: Kiln's own worker, runner and scheduler under the plugin's
names (so the platform really runs models), and communicators that fail the interface check on
purpose."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from kiln.plugin_api import (
    CommonAttentionMetadata,
    CPUAttentionBackend,
    DeltaMessage,
    EagerGraphWrapper,
    KilnConfig,
    ModelRunner,
    ModelRunnerBase,
    Scheduler,
    ThinkTagReasoningParser,
    ToolParser,
    TorchDistCommunicator,
    Worker,
)


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


class DynamicBatchScheduler(Scheduler):
    """The documented extension point (a ``SchedulerDynamicBatch``-style scheduler): each step's
    token budget is chosen before ``super().schedule()`` (here the config's and half of it in
    turn; a real one would follow measured step times), never above the config's."""

    def __init__(self, config: KilnConfig, num_blocks: int) -> None:
        super().__init__(config, num_blocks)
        self.max_budget = self.max_num_batched_tokens

    def schedule(self) -> Any:
        is_full = self.max_num_batched_tokens == self.max_budget
        self.max_num_batched_tokens = self.max_budget // 2 if is_full else self.max_budget
        return super().schedule()


class OverBudgetScheduler(Scheduler):
    """Breaks the contract: schedules twice the config's token budget."""

    def __init__(self, config: KilnConfig, num_blocks: int) -> None:
        super().__init__(config, num_blocks)
        self.max_num_batched_tokens *= 2


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


class CopyReduceCommunicator(TorchDistCommunicator):
    """Breaks the contract: reduces in place but returns a copy taken before the reduction."""

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        before = tensor.clone()
        super().all_reduce(tensor)
        return before


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


ReferenceMetadataBuilder = CPUAttentionBackend.get_metadata_builder_cls()


class ChunkBlindMetadataBuilder(ReferenceMetadataBuilder):  # type: ignore[misc,valid-type]
    """Right for a prompt computed in one step, wrong for a later prefill chunk or a prefix-cache
    hit: such a chunk's context is cut to as many positions as it has new tokens (the first ones,
    not its own), as if nothing were cached before it."""

    def build(self, common: CommonAttentionMetadata) -> Any:
        query_lens = common.query_start_loc[1:] - common.query_start_loc[:-1]
        is_chunk = (query_lens > 1) & (common.num_computed_tokens > 0)
        blind = dataclasses.replace(
            common,
            seq_lens=torch.where(is_chunk, query_lens, common.seq_lens),
            num_computed_tokens=torch.where(is_chunk, 0, common.num_computed_tokens),
        )
        return super().build(blind)


class ChunkBlindAttentionBackend(CPUAttentionBackend):
    """The CPU backend with ``ChunkBlindMetadataBuilder``: passes a greedy check whose prompts
    fit one step and miss the prefix cache, fails one with a small token budget."""

    @staticmethod
    def get_metadata_builder_cls() -> type[ChunkBlindMetadataBuilder]:
        return ChunkBlindMetadataBuilder


class CountingGraphWrapper(EagerGraphWrapper):
    """Kiln's eager wrapper, counting its calls. With ``KILN_TEST_GRAPH_LOG`` set, each
    ``capture`` appends ``"tp=<size> pp=<size> rank=<rank> capture <sizes>"`` to that file."""

    calls = 0

    def capture(self, num_tokens: Any) -> None:
        path = os.environ.get("KILN_TEST_GRAPH_LOG")
        if path:
            parallel = self.config.parallel
            with open(path, "a") as f:
                f.write(
                    f"tp={parallel.tensor_parallel_size} pp={parallel.pipeline_parallel_size} "
                    f"rank={parallel.rank} capture {list(num_tokens)}\n"
                )
        super().capture(num_tokens)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        type(self).calls += 1
        return super().__call__(*args, **kwargs)


class PlainToolParser(ToolParser):
    """A tool parser that finds no calls: the whole answer is content."""

    def extract_tool_calls_streaming(self, delta_text: str) -> DeltaMessage:
        return DeltaMessage(content=delta_text)

    def finish(self) -> DeltaMessage:
        return DeltaMessage()


class ReasonTagReasoningParser(ThinkTagReasoningParser):
    """Thinking between ``<reason>`` and ``</reason>``."""

    start_tag = "<reason>"
    end_tag = "</reason>"


class MisspeltModel(torch.nn.Module):
    """A model with ``compute_logit`` for ``compute_logits``: ``kiln plugins`` must refuse it."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return input_ids

    def compute_logit(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states

    def load_weights(self, weights: object) -> set[str]:
        return set()

    def attention_layers(self) -> dict[str, object]:
        return {}
