"""The scheduler interface (named by ``scheduler_cls``; Kiln's own scheduler is the default).

A scheduler thinks in token budgets: each ``schedule()`` hands out ``{request_id: num_new_tokens}``
within ``max_num_batched_tokens`` and ``max_num_seqs`` and returns a plain ``SchedulerOutput``;
``update_from_output()`` takes the ``ModelRunnerOutput`` of that step and returns the per-request
outputs for the front end. Neither call touches a device or a model.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kiln.config import KilnConfig


class SchedulerInterface(ABC):
    @abstractmethod
    def __init__(self, config: KilnConfig, num_blocks: int) -> None: ...

    @abstractmethod
    def add_request(self, request: Any) -> None:
        """Queue a new request."""

    @abstractmethod
    def schedule(self) -> Any:
        """Choose this step's work; returns a ``SchedulerOutput``."""

    @abstractmethod
    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        """Apply the step's sampled tokens; returns the outputs of the requests that advanced."""

    @abstractmethod
    def finish_requests(self, request_ids: Iterable[str], finished_status: Any) -> None:
        """Finish requests early (abort, client gone) and free their blocks."""

    @abstractmethod
    def has_unfinished_requests(self) -> bool: ...

    @abstractmethod
    def get_num_unfinished_requests(self) -> int: ...
