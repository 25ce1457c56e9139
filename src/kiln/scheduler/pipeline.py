"""The scheduler's policy for pipeline parallelism: batches in flight and micro-batches.

With ``parallel.pipeline_parallel_size = N > 1`` the engine core schedules the next batch while
earlier ones are still in the pipeline (``kiln.engine.core``). ``InFlightBatches`` is what the
scheduler knows of them:
- a request in a batch in flight (``in_flight``) is not scheduled again, nor preempted
  (``victim_index``), until ``update_from_output`` has applied that batch (``finish``);
- a batch takes at most ``1/N`` of the unfinished requests, rounded up
  (``max_num_batch_reqs``): requests that arrive together are split into micro-batches that keep
  every stage busy, instead of one batch that leaves all stages but one idle;
- the running requests' tokens go out with the step (``input_token_ids``, into
  ``CachedRequestData.new_token_ids``) for the stages that do not sample.

Without a pipeline the scheduler holds ``SingleBatch``, the null object: nothing is ever in
flight and a batch takes up to ``max_num_seqs`` requests.

This module knows nothing about blocks, budgets or tensors: request ids and token ids only.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Set as AbstractSet

from kiln.messages import CachedRequestData
from kiln.scheduler.request import Request


class SingleBatch:
    """No pipeline: one batch at a time, so none in flight while scheduling."""

    in_flight: AbstractSet[str] = frozenset()
    """Requests in a batch that ``update_from_output`` has not applied: none."""

    def max_num_batch_reqs(self, num_unfinished: int, max_num_seqs: int) -> int:
        """The most requests one batch takes: ``max_num_seqs``."""
        return max_num_seqs

    def victim_index(self, running: list[Request], req_index: int) -> int:
        """Where in ``running`` the next request to preempt is: the last."""
        return -1

    def start(self, request_ids: Iterable[str]) -> None:
        """A batch of ``request_ids`` is scheduled."""

    def finish(self, request_ids: Iterable[str]) -> None:
        """The batch of ``request_ids`` is applied."""

    def add_input_tokens(
        self, cached: CachedRequestData, request: Request, num_new_tokens: int
    ) -> None:
        """Nothing: every rank that runs the step samples (``CachedRequestData.new_token_ids``
        stays empty)."""


class InFlightBatches(SingleBatch):
    """The requests of the batches of a pipeline of ``num_stages`` stages that are scheduled and
    not yet applied."""

    def __init__(self, num_stages: int) -> None:
        assert num_stages > 1, num_stages
        self.num_stages = num_stages
        self.in_flight: set[str] = set()
        """Requests in a batch that ``update_from_output`` has not applied."""

    def max_num_batch_reqs(self, num_unfinished: int, max_num_seqs: int) -> int:
        """The most requests one batch takes: a stage's share of ``num_unfinished`` (running
        and waiting), at least 1 (admission still holds ``max_num_seqs`` running)."""
        return max(1, -(-num_unfinished // self.num_stages))

    def victim_index(self, running: list[Request], req_index: int) -> int:
        """Where in ``running`` the next request to preempt is, while scheduling the one at
        ``req_index``: the last not in flight (its blocks are being written; the request at
        ``req_index`` is never in flight, so there is one)."""
        in_flight = self.in_flight
        if not in_flight:
            return -1
        return next(
            i
            for i in range(len(running) - 1, req_index - 1, -1)
            if running[i].request_id not in in_flight
        )

    def start(self, request_ids: Iterable[str]) -> None:
        """A batch of ``request_ids`` enters the pipeline."""
        self.in_flight.update(request_ids)

    def finish(self, request_ids: Iterable[str]) -> None:
        """The batch of ``request_ids`` is applied: they may be scheduled again."""
        self.in_flight.difference_update(request_ids)

    def add_input_tokens(
        self, cached: CachedRequestData, request: Request, num_new_tokens: int
    ) -> None:
        """The running request's next ``num_new_tokens`` tokens go out with the step, for the
        stages that do not sample."""
        cached.new_token_ids.append(input_token_ids(request, num_new_tokens))


def input_token_ids(request: Request, num_new_tokens: int) -> list[int]:
    """The ``num_new_tokens`` tokens the request computes next (from ``num_computed_tokens``)."""
    start, end = request.num_computed_tokens, request.num_computed_tokens + num_new_tokens
    num_prompt = request.num_prompt_tokens
    if start >= num_prompt:
        return request.output_token_ids[start - num_prompt : end - num_prompt]
    return (request.prompt_token_ids + request.output_token_ids)[start:end]
