"""The pooling runner's output stage: a prompt's final hidden states -> one vector per request.

With ``model.runner == "pooling"`` the runner's last two stages are ``PoolingOutput``'s instead
of ``SamplingOutput``'s (``kiln.worker.output``): no logits, no sampling. The hidden states it
pools are the model's output, after the final norm and before the LM head (transformers'
``last_hidden_state``). Per request, over its prefill chunks:

- LAST: the last prompt position's state (computed in the step that finishes the prompt);
- MEAN: the mean over every prompt position, summed chunk by chunk in float32;
- CLS: the first position's state.

MEAN and CLS need positions a prefix-cache hit would skip, so the scheduler never gives such a
request a hit (``kiln.scheduler.admission.PoolingPrefix``); a resumed (preempted) request starts
its sums afresh. In the step that computes a request's last prompt token its vector is cut to
its ``dimensions`` (Matryoshka truncation), L2-normalised when its ``normalize`` (or the
server's ``--pooler-config``) says so, and answered in ``ModelRunnerOutput.pooler_output`` as
float32 little-endian bytes; the scheduler then finishes it.

This module knows the step plan and the hidden states, nothing of scheduling or of the model.
"""

from __future__ import annotations

import torch

from kiln.messages import CachedRequestData, ModelRunnerOutput, NewRequestData
from kiln.pooling_params import PoolingParams
from kiln.worker.input_batch import InputBatch
from kiln.worker.output import OutputStage
from kiln.worker.stages import RunnerStage
from kiln.worker.step_plan import SampledTokens, StepPlan


def finish_vector(vector: torch.Tensor, dimensions: int | None, normalize: bool) -> bytes:
    """``vector`` [H] float32 cut to its first ``dimensions`` values, then L2-normalised when
    ``normalize``: its float32 little-endian bytes."""
    if dimensions is not None:
        vector = vector[:dimensions]
    if normalize:
        vector = torch.nn.functional.normalize(vector, dim=-1)
    return vector.cpu().numpy().astype("<f4").tobytes()


class PoolingOutput(RunnerStage, OutputStage):
    """Pools each request's prompt (see the module docstring); a runner stage too, to hear of
    requests joining and leaving the batch.

    Args:
        pooling_type: ``model.pooling_type`` (LAST, MEAN or CLS).
        normalize: ``model.pooling_normalize``, for requests whose params leave it None.
    """

    def __init__(self, pooling_type: str, normalize: bool) -> None:
        self.pooling_type = pooling_type
        self.normalize = normalize
        self._params: dict[str, PoolingParams] = {}
        self._partial: dict[str, torch.Tensor] = {}
        """MEAN: the float32 sum of the positions computed so far; CLS: the first position's
        state. [H] each."""

    def add_requests(self, new_reqs: list[NewRequestData]) -> None:
        for new in new_reqs:
            self._params[new.req_id] = new.pooling_params or PoolingParams()
            self._partial.pop(new.req_id, None)  # resumed: pooled afresh

    def remove_requests(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            self._params.pop(req_id, None)
            self._partial.pop(req_id, None)

    def receive_tokens(self, batch: InputBatch, cached: CachedRequestData) -> None:
        """Nothing: a pooling request gets no tokens."""

    def sample(self, plan: StepPlan, hidden_states: torch.Tensor) -> SampledTokens:
        """Pool this step's chunk of every request; the vectors of those whose prompt ends
        here. ``hidden_states``: [T (padded), H]."""
        starts = plan.common.query_start_loc.tolist()
        computed = plan.common.num_computed_tokens.tolist()
        pooled: dict[str, bytes] = {}
        for i, req_id in enumerate(plan.req_ids):
            chunk = hidden_states[starts[i] : starts[i + 1]]  # [n, H]
            vector = self._pool_chunk(req_id, chunk, computed[i])
            if plan.is_partial[i]:
                continue
            if self.pooling_type == "MEAN":
                num_prompt = int(plan.batch.num_prompt_tokens[plan.rows[i]])
                vector = self._partial.pop(req_id) / num_prompt
            elif self.pooling_type == "CLS":
                vector = self._partial.pop(req_id)
            params = self._params[req_id]
            normalize = self.normalize if params.normalize is None else params.normalize
            pooled[req_id] = finish_vector(vector, params.dimensions, normalize)
        return SampledTokens([], pooled=pooled)

    def _pool_chunk(self, req_id: str, chunk: torch.Tensor, start: int) -> torch.Tensor:
        """Take one chunk (``chunk`` [n, H], positions ``start ..``) into the request's pooling;
        the chunk's last state in float32 (LAST's vector when the prompt ends here)."""
        if self.pooling_type == "MEAN":
            assert start == 0 or req_id in self._partial, "MEAN pools every position"
            total = chunk.to(torch.float32).sum(dim=0)
            self._partial[req_id] = self._partial[req_id] + total if start else total
        elif self.pooling_type == "CLS" and start == 0:
            self._partial[req_id] = chunk[0].to(torch.float32)
        return chunk[-1].to(torch.float32)

    def commit(self, plan: StepPlan, sampled: SampledTokens) -> ModelRunnerOutput:
        """The step's tokens count as computed; no token is sampled."""
        plan.batch.num_computed_tokens[plan.rows] = plan.num_computed_after
        return ModelRunnerOutput(
            req_ids=plan.req_ids,
            req_id_to_index={req_id: i for i, req_id in enumerate(plan.req_ids)},
            sampled_token_ids=[[] for _ in plan.req_ids],
            pooler_output=sampled.pooled,
            failed_requests=plan.failed_requests,
            kv_connector_output=plan.kv_connector_output,
        )


__all__ = ["PoolingOutput", "finish_vector"]
