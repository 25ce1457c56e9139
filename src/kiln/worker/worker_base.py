"""The worker and model-runner interfaces a platform implements (named by ``worker_cls`` and
``model_runner_cls``).

A worker owns one device: it initialises it, loads the model through its model runner, sizes and
allocates the KV cache, and executes each step's ``SchedulerOutput``. The model runner turns a
``SchedulerOutput`` into input tensors and attention metadata, runs the model and the sampler, and
returns a ``ModelRunnerOutput`` (token ids, logprobs). Both cross no process boundary themselves:
executors call them with plain dataclasses.

Kiln checks, when it resolves the names, that a platform's classes have these methods with these
parameters; subclassing is optional. These are exactly the members the core calls: the reference
``Worker`` uses nothing of its model runner beyond ``ModelRunnerBase``, and executors nothing of a
worker beyond ``WorkerBase``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from kiln.config import KilnConfig


class ModelRunnerBase(ABC):
    """Runs the model for one device."""

    @abstractmethod
    def __init__(self, config: KilnConfig, device: torch.device) -> None: ...

    @abstractmethod
    def load_model(self) -> None:
        """Build the model and load its weights onto the device."""

    @abstractmethod
    def get_kv_cache_bytes_per_block(self) -> int:
        """Bytes one KV-cache block takes over all layers (K and V)."""

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` blocks per layer and bind them to the attention layers."""

    @abstractmethod
    def get_max_model_len(self) -> int:
        """The context length of the loaded model (capped by ``model.max_model_len``); valid
        after ``load_model``."""

    @abstractmethod
    def dummy_run(self, num_tokens: int) -> None:
        """Run the model once on ``num_tokens`` dummy tokens without attention metadata (a
        warm-up before serving; attention layers return zeros and write no KV cache)."""

    @abstractmethod
    def capture_model(self) -> list[int]:
        """Capture or compile the graph wrapper's decode buckets before serving; returns the
        batch sizes captured (empty when the platform captures nothing). Runs after
        ``initialize_kv_cache``."""

    @abstractmethod
    def execute_model(self, scheduler_output: Any) -> Any:
        """Run one step: ``SchedulerOutput`` in, ``ModelRunnerOutput`` out."""


class WorkerBase(ABC):
    """One device's worker, driven by an executor."""

    @abstractmethod
    def __init__(
        self, config: KilnConfig, local_rank: int, rank: int, distributed_init_method: str
    ) -> None: ...

    @abstractmethod
    def init_device(self) -> None:
        """Select the device, seed it, and join the distributed group."""

    @abstractmethod
    def load_model(self) -> None:
        """Load the model through the model runner."""

    @abstractmethod
    def determine_available_memory(self) -> int:
        """Bytes the KV cache may take on this device, after the model is loaded."""

    @abstractmethod
    def get_kv_cache_bytes_per_block(self) -> int:
        """Bytes one KV-cache block takes on this device (all layers, K and V)."""

    @abstractmethod
    def get_max_model_len(self) -> int:
        """The context length the loaded model supports (capped by ``model.max_model_len``)."""

    @abstractmethod
    def initialize_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache."""

    @abstractmethod
    def compile_or_warm_up_model(self) -> None:
        """Capture graphs or run warm-up passes before serving."""

    @abstractmethod
    def execute_model(self, scheduler_output: Any) -> Any:
        """Run one step and return the ``ModelRunnerOutput`` (rank 0) or None."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release the device and the distributed group."""
