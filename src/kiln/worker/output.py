"""The step's last two stages, ``sample`` and ``commit``, per pipeline role.

- ``SamplingOutput`` (the last pipeline stage; a runner without pipeline parallelism): logits
  for the step's sampling positions, the grammar mask, the strategy's sampler (plain, or a
  verification of drafts), prompt logprobs; then the tokens into the batch, logprobs per
  request, and the next step's drafts.
- ``FollowLastStage`` (a stage before the last): it samples nothing; the step's tokens count as
  computed, and the last stage's sampled tokens arrive with a later step's
  ``CachedRequestData.new_token_ids`` (``receive_tokens``), so the next batch can start here
  without waiting for the last stage.

Logprobs leave the runner complete and per request: the sampled tokens' rows of each request
that asked, and a request's prompt logprobs whole in the step that samples its first token.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np
import torch

from kiln.messages import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    CachedRequestData,
    LogprobsLists,
    ModelRunnerOutput,
)
from kiln.sampling.metadata import SamplingMetadata
from kiln.worker.input_batch import InputBatch
from kiln.worker.sampling import PlainSampling
from kiln.worker.stages import GrammarMask, PromptLogprobs
from kiln.worker.step_plan import NOTHING_SAMPLED, SampledTokens, StepPlan


class OutputStage(ABC):
    """What a rank makes of the forward's hidden states (see the module docstring)."""

    @abstractmethod
    def receive_tokens(self, batch: InputBatch, cached: CachedRequestData) -> None:
        """Take the tokens another rank sampled (``cached.new_token_ids``) into the batch."""

    @abstractmethod
    def sample(self, plan: StepPlan, hidden_states: torch.Tensor) -> SampledTokens:
        """The step's tokens; ``hidden_states`` [T (padded), hidden]."""

    @abstractmethod
    def commit(self, plan: StepPlan, sampled: SampledTokens) -> ModelRunnerOutput:
        """Write the step into the batch (computed tokens, sampled tokens); the step's answer."""


class FollowLastStage(OutputStage):
    """A pipeline stage before the last: it samples nothing and takes the last stage's tokens."""

    def receive_tokens(self, batch: InputBatch, cached: CachedRequestData) -> None:
        """The tokens the last stage sampled since this stage last ran each request."""
        for req_id, num_computed, new_token_ids in zip(
            cached.req_ids, cached.num_computed_tokens, cached.new_token_ids, strict=False
        ):
            row = batch.req_id_to_index[req_id]
            num_missing = num_computed + len(new_token_ids) - int(batch.num_tokens[row])
            for token_id in new_token_ids[len(new_token_ids) - num_missing :]:
                batch.append_token(row, token_id)

    def sample(self, plan: StepPlan, hidden_states: torch.Tensor) -> SampledTokens:
        return NOTHING_SAMPLED

    def commit(self, plan: StepPlan, sampled: SampledTokens) -> ModelRunnerOutput:
        """Count the step's tokens computed and answer nothing, without waiting for the last
        stage."""
        plan.batch.num_computed_tokens[plan.rows] += plan.num_scheduled
        return EMPTY_MODEL_RUNNER_OUTPUT


class SamplingOutput(OutputStage):
    """The last pipeline stage: it samples with ``strategy`` and commits the tokens.

    Args:
        model: the target (its ``compute_logits``).
        strategy: plain or speculative sampling (``kiln.worker.sampling``).
        grammar_mask: the scheduler's grammar bitmask over the logits.
        prompt_logprobs: the runner's prompt-logprobs stage.
    """

    def __init__(
        self,
        model: Any,
        strategy: PlainSampling,
        grammar_mask: GrammarMask,
        prompt_logprobs: PromptLogprobs,
    ) -> None:
        self.model = model
        self.strategy = strategy
        self.grammar_mask = grammar_mask
        self.prompt_logprobs = prompt_logprobs

    def receive_tokens(self, batch: InputBatch, cached: CachedRequestData) -> None:
        """Nothing: this rank sampled them."""

    def sample(self, plan: StepPlan, hidden_states: torch.Tensor) -> SampledTokens:
        logits = self.model.compute_logits(hidden_states[plan.logits_indices])  # [P, V]
        metadata = plan.sampler.metadata(plan.batch, plan.rows)
        saved = _save_partial_generators(plan, metadata)
        logits = self.grammar_mask(logits, plan)
        tokens, logprobs_tensors = plan.sampler.sample(logits, metadata, plan.req_ids)
        for position, state in saved.items():
            metadata.generators[position].set_state(state)
        prompt_logprobs = self.prompt_logprobs.compute(
            plan, hidden_states, self.model.compute_logits
        )
        rows_logprobs = None
        if logprobs_tensors is not None:
            rows_logprobs = LogprobsLists(*logprobs_tensors.tolists())
        return SampledTokens(tokens, rows_logprobs, prompt_logprobs)

    def commit(self, plan: StepPlan, sampled: SampledTokens) -> ModelRunnerOutput:
        batch = plan.batch
        sampled_token_ids: list[list[int]] = []
        logprobs: dict[str, LogprobsLists] = {}
        for i, row in enumerate(plan.rows):
            if plan.is_partial[i]:
                batch.num_computed_tokens[row] = plan.num_computed_after[i]
                sampled_token_ids.append([])
                continue
            new_tokens = sampled.tokens[i]
            # Rejected drafts are not computed tokens: their slots are written over later.
            num_rejected = plan.num_positions[i] - len(new_tokens)
            batch.num_computed_tokens[row] = plan.num_computed_after[i] - num_rejected
            for token_id in new_tokens:
                batch.append_token(row, token_id)
            sampled_token_ids.append(new_tokens)
            wants_logprobs = batch.requests[row].sampling_params.logprobs is not None
            if sampled.logprobs is not None and wants_logprobs:
                start = int(plan.logits_starts[i])
                logprobs[plan.req_ids[i]] = sampled.logprobs.slice(start, start + len(new_tokens))
        return ModelRunnerOutput(
            req_ids=plan.req_ids,
            req_id_to_index={req_id: i for i, req_id in enumerate(plan.req_ids)},
            sampled_token_ids=sampled_token_ids,
            logprobs=logprobs,
            prompt_logprobs_dict=sampled.prompt_logprobs,
            spec_token_ids=self.strategy.propose(batch, plan.rows, sampled_token_ids),
            failed_requests=plan.failed_requests,
            kv_connector_output=plan.kv_connector_output,
        )


def _save_partial_generators(plan: StepPlan, metadata: SamplingMetadata) -> dict[int, Any]:
    """The generator states of the seeded requests that sample nothing this step (still inside
    their prompt), by logits row: restored after sampling, so a generator does not advance and
    a seed gives the same tokens however the prompt was chunked."""
    last_rows = (plan.logits_starts + plan.num_positions - 1).tolist()
    partial_rows = (last_rows[i] for i in np.flatnonzero(plan.is_partial).tolist())
    return {p: metadata.generators[p].get_state() for p in partial_rows if p in metadata.generators}
