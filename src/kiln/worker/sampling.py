"""Sampling strategies: how a step's logits become tokens.

A strategy is a runner stage (``kiln.worker.stages``) that, per step, (1) before the inputs are
read, returns the step's ``StepSampler`` (``step_sampler``), which says which logits rows each
request gets and samples them, and (2) once the step's tokens are in the batch, proposes the
next step's drafts (``propose``).

- ``PlainSampling``: one logits row per request (its last scheduled token), the ``Sampler``.
- ``SpeculativeSampling`` (``kiln.spec_decode.speculator``): a step with drafts gets logits at
  each drafting request's last ``1 + k`` positions, each sampled with the metadata of its
  position, and the platform's rejection sampler decides what it emits (its accepted drafts and
  one more token); a step without drafts is sampled plainly. After every step the platform's
  proposer drafts the next step's tokens of the requests that emitted some.

A new way to sample (pooling, say) is a new strategy here, not a branch in the runner. This
module knows the persistent batch and the sampler, nothing of the model or of scheduling.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np
import torch

from kiln.messages import NewRequestData
from kiln.model_executor.layers.attention import CommonAttentionMetadata
from kiln.sampling.metadata import SamplingMetadata
from kiln.sampling.sampler import LogprobsTensors, Sampler
from kiln.spec_decode.speculator import Speculator
from kiln.spec_decode.verify import emitted_tokens, logits_positions
from kiln.worker.input_batch import InputBatch
from kiln.worker.stages import RunnerStage


class StepSampler(ABC):
    """One step's sampling, for its requests in batch order (request ``i``)."""

    num_positions: np.ndarray
    """[R] int64: logits rows per request."""

    @abstractmethod
    def logits_indices(self, common: CommonAttentionMetadata) -> torch.Tensor:
        """[P] int64: the token rows whose logits are computed, request by request."""

    @abstractmethod
    def metadata(self, batch: InputBatch, rows: list[int]) -> SamplingMetadata:
        """Sampling metadata with a row per logits row."""

    @abstractmethod
    def sample(
        self, logits: torch.Tensor, metadata: SamplingMetadata, req_ids: list[str]
    ) -> tuple[list[list[int]], LogprobsTensors | None]:
        """Per request its new tokens (read back: the step's host sync), and the logprobs of
        every logits row's token when some request asked. ``logits``: [P, V]."""


class PlainSampler(StepSampler):
    """Each request's last scheduled token's logits, sampled by the ``Sampler``."""

    def __init__(self, sampler: Sampler, num_reqs: int) -> None:
        self.sampler = sampler
        self.num_positions = np.ones(num_reqs, dtype=np.int64)

    def logits_indices(self, common: CommonAttentionMetadata) -> torch.Tensor:
        return common.query_start_loc[1:].to(torch.int64) - 1  # [R]

    def metadata(self, batch: InputBatch, rows: list[int]) -> SamplingMetadata:
        return batch.sampling_metadata(rows)

    def sample(
        self, logits: torch.Tensor, metadata: SamplingMetadata, req_ids: list[str]
    ) -> tuple[list[list[int]], LogprobsTensors | None]:
        output = self.sampler(logits, metadata)
        tokens = [[t] for t in output.sampled_token_ids.tolist()]  # the step's one host sync
        return tokens, output.logprobs_tensors


class DraftVerifier(StepSampler):
    """A step with drafts: every request's last ``1 + k`` positions (``k`` its drafts, maybe 0),
    verified by the speculator's rejection sampler."""

    def __init__(self, speculator: Speculator, sampler: Sampler, drafts: list[list[int]]) -> None:
        self.speculator = speculator
        self.sampler = sampler
        self.drafts = drafts
        self.num_positions = 1 + np.array([len(d) for d in drafts], dtype=np.int64)

    def logits_indices(self, common: CommonAttentionMetadata) -> torch.Tensor:
        query_start_loc = common.query_start_loc.numpy().astype(np.int64)
        return torch.from_numpy(logits_positions(query_start_loc, self.num_positions - 1))  # [P]

    def metadata(self, batch: InputBatch, rows: list[int]) -> SamplingMetadata:
        return self.speculator.expand_metadata(batch, rows, self.drafts)

    def sample(
        self, logits: torch.Tensor, metadata: SamplingMetadata, req_ids: list[str]
    ) -> tuple[list[list[int]], LogprobsTensors | None]:
        logprobs_tensors, verified = self.speculator.verify(
            self.sampler, logits, metadata, req_ids, self.drafts
        )
        return emitted_tokens(*verified, [len(d) for d in self.drafts]), logprobs_tensors


class PlainSampling(RunnerStage):
    """No speculation: every step is sampled plainly and nothing is proposed."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def step_sampler(
        self, batch: InputBatch, rows: list[int], spec_tokens: dict[str, list[int]]
    ) -> StepSampler:
        """The step's sampler; called before the step's inputs are read from the batch."""
        return PlainSampler(self.sampler, len(rows))

    def propose(
        self, batch: InputBatch, rows: list[int], sampled_token_ids: list[list[int]]
    ) -> list[list[int]]:
        """Drafts for the next step, per row; empty: this strategy proposes none."""
        return []


class SpeculativeSampling(PlainSampling):
    """Speculative decoding with the platform's proposer and rejection sampler (``speculator``)."""

    def __init__(self, sampler: Sampler, speculator: Speculator) -> None:
        super().__init__(sampler)
        self.speculator = speculator

    def load_model(self, model: Any, platform: Any) -> None:
        self.speculator.load_model(model, platform)

    def get_kv_cache_bytes_per_block(self) -> int:
        """A draft model's keys and values of one block (its own cache, the same block ids)."""
        return self.speculator.get_kv_cache_bytes_per_block()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.speculator.initialize_kv_cache(num_blocks)

    def add_requests(self, new_reqs: list[NewRequestData]) -> None:
        # Resumed after preemption: the proposer forgets it (a draft model's cache of it is
        # rebuilt).
        self.speculator.remove_requests([new.req_id for new in new_reqs])

    def remove_requests(self, req_ids: list[str]) -> None:
        self.speculator.remove_requests(req_ids)

    def step_sampler(
        self, batch: InputBatch, rows: list[int], spec_tokens: dict[str, list[int]]
    ) -> StepSampler:
        """Writes the step's drafts after their rows' tokens (where the inputs are read)."""
        drafts = self.speculator.write_drafts(batch, rows, spec_tokens)
        if drafts is None:  # nothing to verify this step
            return super().step_sampler(batch, rows, spec_tokens)
        return DraftVerifier(self.speculator, self.sampler, drafts)

    def propose(
        self, batch: InputBatch, rows: list[int], sampled_token_ids: list[list[int]]
    ) -> list[list[int]]:
        return self.speculator.propose(batch, rows, sampled_token_ids)
