"""One step of the model runner as data: what ``prepare`` decided, read by the later stages.

The runner's step is ``prepare -> forward -> sample -> commit`` (``kiln.worker.model_runner``):
``prepare`` applies nothing and computes everything the step needs from the persistent batch and
the ``SchedulerOutput`` into a ``StepPlan``; ``forward`` runs the model over its inputs;
``sample`` turns hidden states into ``SampledTokens`` (the pooling runner: into vectors);
``commit`` writes them into the batch and answers the ``ModelRunnerOutput``. Each stage reads
the plan and none keeps it past the step.

This module holds data only: no model, no device work.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kiln.messages import KVConnectorOutput, LogprobsLists, SchedulerOutput
from kiln.model_executor.layers.attention import CommonAttentionMetadata

if TYPE_CHECKING:
    from kiln.worker.input_batch import InputBatch
    from kiln.worker.sampling import StepSampler


@dataclass
class StepPlan:
    """One step's work. Request ``i`` below is the ``i``-th scheduled row of the batch."""

    scheduler_output: SchedulerOutput
    batch: InputBatch
    rows: list[int]
    """The batch rows of the requests scheduled this step, in batch order."""
    req_ids: list[str]
    num_scheduled: np.ndarray
    """[R] int64: tokens scheduled per request."""
    num_computed_after: np.ndarray
    """[R] int64: each request's computed tokens once this step's are (drafts included)."""
    is_partial: np.ndarray
    """[R] bool: still inside its prompt after this step (samples nothing)."""
    input_ids: torch.Tensor
    """[T] int64 on the device."""
    positions: torch.Tensor
    """[T] int64 on the device."""
    common: CommonAttentionMetadata
    sampler: StepSampler
    """How this step's logits become tokens (plain sampling or draft verification)."""
    logits_indices: torch.Tensor
    """[P] int64: the token rows whose logits are computed, request by request."""
    num_positions: np.ndarray
    """[R] int64: logits rows per request (1, or ``1 + k`` verifying ``k`` drafts)."""
    logits_starts: np.ndarray
    """[R] int64: request ``i``'s first logits row (its rows are ``logits_starts[i] ..``)."""
    failed_requests: dict[str, str] = field(default_factory=dict)
    """Requests that failed in this step for a reason of their own (a stage fills it)."""
    kv_connector: Any = None
    """The KV connector whose layer hooks the attention layers call this step (None: none)."""
    kv_connector_output: KVConnectorOutput | None = None
    """The KV connector's report of the step (its stage fills it after the forward)."""

    @property
    def num_reqs(self) -> int:
        return len(self.rows)


@dataclass(frozen=True)
class SampledTokens:
    """What ``sample`` produced: per request its tokens, and the logprobs rows."""

    tokens: list[list[int]]
    """Per request: its new tokens (one, or its accepted drafts and one more); ignored for a
    request that is partial."""
    logprobs: LogprobsLists | None = None
    """[P] rows (logits row order), when some request asked for logprobs."""
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    """Per request whose prefill finished this step and that asked: all its prompt logprobs."""
    pooled: dict[str, bytes] = field(default_factory=dict)
    """The pooling runner: per request whose prompt finished this step, its pooled vector
    (float32 little-endian bytes; ``kiln.worker.pooling``)."""


NOTHING_SAMPLED = SampledTokens([])
"""A stage that samples nothing (a pipeline stage before the last)."""
