"""Kiln's scheduler: token budgets over a paged KV cache, as in vLLM v1.

Each ``schedule()`` hands out ``{request_id: num_new_tokens}`` under ``max_num_batched_tokens`` and
``max_num_seqs``:
1. Running requests first, in ``(priority, arrival)`` order: a decode gets 1 token, a partially
   prefilled request the rest of its prompt up to the budget. When its blocks cannot be allocated,
   the running request that sorts last is preempted by recompute (its blocks freed, status
   PREEMPTED, back into the waiting queue) until the allocation fits or the request preempts itself.
   Preemptees are never already scheduled in the step, since they are taken from the end.
2. Then, unless the step preempted someone, waiting requests in ``(priority, arrival)`` order while
   the budget, ``max_num_seqs`` and free blocks allow. Prefix-cache hits reduce the tokens to
   compute. A prompt longer than the remaining budget is split over steps (chunked prefill); with
   ``enable_chunked_prefill=False`` it waits for a step with room instead, unless it is longer than
   the whole budget, which it could never get: then it is split anyway.
   Admission rules the scheduler composes (``kiln.scheduler.admission``) may hold the head of
   the queue back (and the queue behind it) or keep it from prefix-cache hits: with LoRA, a
   request for an adapter that no running request uses waits while ``lora.max_loras`` other
   adapters run (a step fits that many slots); a request that asked for prompt logprobs, or a
   MEAN or CLS pooling request, recomputes its cached prefix.

Pooling requests (``--runner pooling``, ``Request.pooling_params``) are prefilled like any
prompt, chunked as the budget says, and finish in the ``update_from_output`` of the step that
computes their last prompt token, with the runner's pooled vector and no output token.

``update_from_output()`` advances ``num_computed_tokens`` by what was scheduled, appends sampled
tokens and checks stops in this order: EOS (unless ``ignore_eos``), ``stop_token_ids`` (both only
once ``min_tokens`` are out), a complete grammar (its stop token accepted: it stops the request
even with ``ignore_eos``), ``max_tokens``, then the context length. Stop *strings* are the front
end's: it aborts the request through ``finish_requests``. Logprobs come from the runner complete
and per request; the scheduler only routes them into the request's output (prompt logprobs with
its first token).

Structured outputs: a request waits outside the queue while its grammar compiles, and a step's
structured requests get bitmask rows (``kiln.scheduler.grammar_waitlist``).

Speculative decoding (``kiln.spec_decode``): the runner proposes drafts for a request in the step
that samples its token (``ModelRunnerOutput.spec_token_ids``); the next ``schedule()`` gives that
request ``1 + k`` tokens, its last token and ``k`` drafts (``SchedulerOutput.
scheduled_spec_decode_tokens``), with KV slots and budget for all of them. ``k`` is cut so that
the budget, the context and ``max_tokens`` hold even if every draft is accepted. After the step
``num_computed_tokens`` takes back the rejected drafts (their slots are written over later; only
full blocks of accepted tokens are cached). A request with a grammar speculates too, as in
vLLM: ``update_from_output`` keeps its drafts up to the first one its grammar forbids, the step
masks each of its ``1 + k`` positions with its own bitmask row (the grammar's state after the
drafts before it), and its matcher advances by the emitted tokens only. With a draft model,
each allocation also holds ``k`` lookahead slots after the scheduled tokens, where the draft
writes the keys and values of its next drafts (``num_lookahead_tokens``, as vLLM).

Pipeline parallelism (``parallel.pipeline_parallel_size > 1``): batches in flight and
micro-batches (``kiln.scheduler.pipeline``): a request in a batch in flight (``in_flight``) is
neither scheduled again nor preempted until ``update_from_output`` has applied that batch.
Without a pipeline the scheduler holds the null ``SingleBatch``: nothing is in flight.

A request that can never fit (``num_prompt_tokens + 1 > max_model_len``, where ``max_model_len`` is
capped by the whole cache's capacity) is not queued: it finishes as FINISHED_IGNORED (finish reason
"length", no tokens) in the next ``update_from_output``. The engine core therefore keeps stepping,
even with nothing scheduled, while ``has_unfinished_requests()``.

The scheduler knows nothing about tensors, devices or text: token ids and block ids only.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from itertools import count

from kiln.config import KilnConfig
from kiln.messages import (
    KV_LOAD_FAILED,
    CachedRequestData,
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    KVConnectorOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
)
from kiln.scheduler.admission import AdmissionRule, LoRASlots, PoolingPrefix, PromptLogprobsPrefix
from kiln.scheduler.drafts import DraftAccounting
from kiln.scheduler.grammar_waitlist import (
    GrammarWaitlist,
    accept_token,
    allowed_drafts,
    grammar_bitmask,
)
from kiln.scheduler.interface import SchedulerInterface
from kiln.scheduler.kv_cache.block_pool import KVCacheBlock
from kiln.scheduler.kv_cache.manager import KVCacheManager
from kiln.scheduler.pipeline import InFlightBatches, SingleBatch
from kiln.scheduler.queue import RequestQueue, SchedulingKey
from kiln.scheduler.request import Request, RequestStatus
from kiln.scheduler.transfers import KVTransfers
from kiln.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)


@dataclass
class _StepBuilder:
    """The step ``schedule()`` is building."""

    token_budget: int
    """Tokens this step may still compute."""
    max_num_batch_reqs: int
    """Most requests this step takes (a pipeline stage's share; else ``max_num_seqs``)."""
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    new_reqs: list[NewRequestData] = field(default_factory=list)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    num_preempted: int = 0

    def has_room_for_another(self) -> bool:
        return self.token_budget > 0 and len(self.num_scheduled_tokens) < self.max_num_batch_reqs

    def schedule(self, request_id: str, num_new_tokens: int) -> None:
        self.num_scheduled_tokens[request_id] = num_new_tokens
        self.token_budget -= num_new_tokens


class Scheduler(SchedulerInterface):
    """Continuous batching with chunked prefill, prefix caching and preemption by recompute.

    Args:
        config: reads ``scheduler.*``, ``cache.block_size``, ``cache.enable_prefix_caching`` and
            ``model.max_model_len`` (None: as long as the cache holds).
        num_blocks: KV-cache blocks, the reserved null block 0 included.
    """

    def __init__(self, config: KilnConfig, num_blocks: int) -> None:
        self.max_num_seqs = config.scheduler.max_num_seqs
        self.max_num_batched_tokens = config.scheduler.max_num_batched_tokens
        self.enable_chunked_prefill = config.scheduler.enable_chunked_prefill
        self.block_size = config.cache.block_size
        capacity = (num_blocks - 1) * self.block_size
        max_model_len = config.model.max_model_len or capacity
        if max_model_len > capacity:
            logger.warning(
                "max_model_len=%d exceeds the KV cache (%d tokens); requests stop at %d tokens",
                max_model_len,
                capacity,
                capacity,
            )
        # A request longer than the whole cache would preempt itself forever: cap it.
        self.max_model_len = min(max_model_len, capacity)
        self.drafts = DraftAccounting(config.speculative.num_lookahead_tokens, self.max_model_len)
        """Draft limits, lookahead slots and acceptance counters (``kiln.scheduler.drafts``)."""
        self.kv_cache_manager = KVCacheManager(
            num_blocks,
            self.block_size,
            enable_caching=config.cache.enable_prefix_caching,
            max_model_len=self.max_model_len,
        )
        self.requests: dict[str, Request] = {}
        """Every unfinished request (waiting or running) by id."""
        self.waiting = RequestQueue()
        self.running: list[Request] = []
        """Kept sorted by scheduling key, so the last one is the next to preempt."""
        self.finished_req_ids: set[str] = set()
        """Finished or preempted since the last ``schedule()``: the runner drops their state."""
        self._keys: dict[str, SchedulingKey] = {}
        self._seq = count()
        self._ignored: dict[str, EngineCoreOutput] = {}
        self._grammar_errors: dict[str, str] = {}
        """Requests whose grammar raised while this scheduler worked on them (their bitmask,
        a token they sampled, their drafts): failed alone at the next ``update_from_output``."""
        self._num_preemptions = 0
        self.structured_output_manager = StructuredOutputManager(config)
        self.waiting_for_grammar = GrammarWaitlist(self.structured_output_manager)
        self.pipeline_parallel_size = config.parallel.pipeline_parallel_size
        self.pipeline = (
            InFlightBatches(self.pipeline_parallel_size)
            if self.pipeline_parallel_size > 1
            else SingleBatch()
        )
        """The batches in flight (``SingleBatch``: none, without a pipeline)."""
        self.admission_rules: list[AdmissionRule] = [
            PromptLogprobsPrefix(),
            PoolingPrefix(config.model.pooling_type),
        ]
        """What each waiting request must pass to start (``kiln.scheduler.admission``)."""
        if config.lora.enable_lora:
            self.admission_rules.append(LoRASlots(config.lora.max_loras))
        self.transfers = KVTransfers(config, self.kv_cache_manager)
        """The KV connector's scheduler side (``kiln.scheduler.transfers``; over the null
        ``NoConnector`` without one): tokens beyond the local prefix cache, the requests whose
        KV loads, and each step's transfers."""

    @property
    def in_flight(self) -> AbstractSet[str]:
        """Requests in a batch that ``update_from_output`` has not applied (pipelined only)."""
        return self.pipeline.in_flight

    # -- requests in and out -------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request, or finish it as ignored when it can never fit (see module doc).

        Raises:
            ValueError: the request id is already in use, or the prompt is empty.
        """
        request_id = request.request_id
        if request_id in self.requests or request_id in self._ignored:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not request.prompt_token_ids:
            raise ValueError(f"request {request_id!r} has an empty prompt")
        if request.num_tokens + 1 > self.max_model_len:
            logger.warning(
                "request %s ignored: %d prompt tokens + 1 exceed max_model_len=%d",
                request_id,
                request.num_tokens,
                self.max_model_len,
            )
            request.status = RequestStatus.FINISHED_IGNORED
            self._ignored[request_id] = EngineCoreOutput(
                request_id, [], finish_reason=FinishReason.LENGTH
            )
            return
        key = (request.priority, request.arrival_time, next(self._seq))
        self._keys[request_id] = key
        self.requests[request_id] = request
        if request.sampling_params.structured_outputs is not None:
            self.waiting_for_grammar.add(request)
            return
        self.waiting.add(request, key)

    def finish_requests(
        self, request_ids: str | Iterable[str], finished_status: RequestStatus
    ) -> None:
        """Finish waiting or running requests early (abort, stop string, client gone).

        Idempotent; unknown or already finished ids are ignored. No output is produced for them.

        Side effects: frees their blocks; they join ``finished_req_ids``.
        """
        assert RequestStatus.is_finished(finished_status), finished_status
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        has_running = False
        for request_id in request_ids:
            self._ignored.pop(request_id, None)
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                has_running = True
            elif request.status == RequestStatus.WAITING_FOR_GRAMMAR:
                self.waiting_for_grammar.remove(request)
            elif request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:  # (released below)
                self.waiting.remove(request)
            request.status = finished_status
            self._free_request(request)
        if has_running:
            self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]

    def has_unfinished_requests(self) -> bool:
        """Unfinished requests, or finished ones whose blocks a KV connector still holds (the
        engine steps on, so the worker can report their transfer done)."""
        return bool(self.requests) or bool(self._ignored) or self.transfers.has_held_blocks()

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests) + len(self._ignored)

    def get_request_counts(self) -> tuple[int, int]:
        """``(num_running, num_waiting)``; waiting includes those waiting for a grammar or for
        their KV to load."""
        num_waiting = len(self.waiting) + len(self.waiting_for_grammar)
        return len(self.running), num_waiting + self.transfers.num_waiting

    # -- one step ------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Choose this step's work (see the module docstring for the policy).

        Side effects: allocates blocks; may preempt running requests; moves admitted requests
        from waiting to running; clears ``finished_req_ids`` into the output.
        """
        self._admit_ready_grammars()
        num_unfinished = len(self.running) + len(self.waiting)
        step = _StepBuilder(
            self.max_num_batched_tokens,
            self.pipeline.max_num_batch_reqs(num_unfinished, self.max_num_seqs),
        )
        self._schedule_running(step)
        # A step that preempted is short of blocks: admitting now would only thrash.
        if not step.num_preempted:
            self._schedule_waiting(step)
        finished_req_ids, self.finished_req_ids = self.finished_req_ids, set()
        self.pipeline.start(step.num_scheduled_tokens)
        grammar_req_ids, bitmask = grammar_bitmask(
            self.structured_output_manager,
            self.requests,
            step.num_scheduled_tokens,
            step.spec_tokens,
            self._grammar_errors,
        )
        output = SchedulerOutput(
            scheduled_new_reqs=step.new_reqs,
            scheduled_cached_reqs=step.cached_reqs,
            num_scheduled_tokens=step.num_scheduled_tokens,
            total_num_scheduled_tokens=self.max_num_batched_tokens - step.token_budget,
            finished_req_ids=finished_req_ids,
            structured_output_request_ids=grammar_req_ids,
            grammar_bitmask=bitmask,
            scheduled_spec_decode_tokens=step.spec_tokens,
        )
        output.kv_connector_metadata = self.transfers.metadata(output)
        return output

    def _schedule_running(self, step: _StepBuilder) -> None:
        """Running requests first, in scheduling order: a decode gets 1 token (and its drafts),
        a partial prefill the rest of its prompt up to the budget; preempts from the end when
        blocks run out."""
        running, in_flight = self.running, self.pipeline.in_flight
        req_index = 0
        while req_index < len(running) and step.has_room_for_another():
            request = running[req_index]
            if request.request_id in in_flight:
                req_index += 1  # its tokens are not back yet
                continue
            num_new_tokens = request.num_tokens - request.num_computed_tokens
            drafts, request.spec_token_ids = request.spec_token_ids, []
            if drafts:
                drafts = drafts[: self.drafts.max_num_drafts(request, step.token_budget)]
                num_new_tokens += len(drafts)
            num_new_tokens = min(num_new_tokens, step.token_budget)
            assert num_new_tokens > 0, request
            new_block_ids = self._allocate_or_preempt(request, num_new_tokens, req_index, step)
            if new_block_ids is None:
                break  # it preempted itself
            cached = step.cached_reqs
            cached.req_ids.append(request.request_id)
            cached.new_block_ids.append(new_block_ids)
            cached.num_computed_tokens.append(request.num_computed_tokens)
            self.pipeline.add_input_tokens(cached, request, num_new_tokens)
            step.schedule(request.request_id, num_new_tokens)
            if drafts:
                step.spec_tokens[request.request_id] = drafts
            req_index += 1

    def _allocate_or_preempt(
        self, request: Request, num_new_tokens: int, req_index: int, step: _StepBuilder
    ) -> list[int] | None:
        """Slots for a running request's ``num_new_tokens``, preempting the running request that
        sorts last (not in flight) until they fit; None when ``request`` preempted itself."""
        lookahead = self.drafts.num_lookahead(request.num_computed_tokens + num_new_tokens)
        running = self.running
        while (
            new_block_ids := self.kv_cache_manager.allocate_slots(
                request, num_new_tokens, num_lookahead_tokens=lookahead
            )
        ) is None:
            victim = running.pop(self.pipeline.victim_index(running, req_index))
            self._preempt(victim)
            step.num_preempted += 1
            if victim is request:
                return None
        return new_block_ids

    def _schedule_waiting(self, step: _StepBuilder) -> None:
        """Then waiting requests in scheduling order while the budget, ``max_num_seqs``, free
        blocks and every admission rule allow; the first that cannot start holds back the
        queue behind it."""
        self._schedule_loaded(step)
        kv, waiting, rules = self.kv_cache_manager, self.waiting, self.admission_rules
        for rule in rules:
            rule.begin_step(self.running)
        while waiting and step.has_room_for_another() and len(self.running) < self.max_num_seqs:
            request = waiting.peek()
            if not all(rule.can_admit(request) for rule in rules):
                break
            hit_blocks, num_hit_tokens = kv.get_computed_blocks(request)
            num_external, load_async = 0, False
            if all(rule.may_reuse_prefix(request) for rule in rules):
                num_external, load_async = self.transfers.num_external_tokens(
                    request, num_hit_tokens
                )
            else:
                hit_blocks, num_hit_tokens = [], 0
            if load_async:
                if not self._start_loading(request, num_hit_tokens, hit_blocks, num_external):
                    break
                continue
            num_computed = num_hit_tokens + num_external
            num_new_tokens = request.num_tokens - num_computed
            if num_new_tokens > step.token_budget:
                if (
                    not self.enable_chunked_prefill
                    and num_new_tokens <= self.max_num_batched_tokens
                ):
                    break  # Fits a later step whole.
                num_new_tokens = step.token_budget
            lookahead = self.drafts.num_lookahead(num_computed + num_new_tokens)
            block_ids = kv.allocate_slots(
                request, num_external + num_new_tokens, num_hit_tokens, hit_blocks, lookahead
            )
            if block_ids is None:
                break
            waiting.pop()
            self.transfers.admitted(request, block_ids, num_external)
            step.new_reqs.append(self._start_running(request, block_ids, num_computed))
            for rule in rules:
                rule.admit(request)
            step.schedule(request.request_id, num_new_tokens)

    def _start_loading(
        self,
        request: Request,
        num_hit_tokens: int,
        hit_blocks: list[KVCacheBlock],
        num_external: int,
    ) -> bool:
        """Admit the head of the queue with blocks for its local hit and the connector's
        ``num_external`` tokens, which load asynchronously (their blocks are not cached until
        they have); False when the blocks are not free."""
        block_ids = self.kv_cache_manager.allocate_slots(
            request, num_external, num_hit_tokens, hit_blocks, delay_caching=True
        )
        if block_ids is None:
            return False
        self.waiting.pop()
        self.transfers.admitted(request, block_ids, num_external)
        self.transfers.start_loading(request, num_hit_tokens, num_external)
        return True

    def _schedule_loaded(self, step: _StepBuilder) -> None:
        """Requests whose asynchronous load finished, from the loaded position, while the budget,
        ``max_num_seqs`` and free blocks allow (a chunk of the rest of the prompt if it is
        longer than the budget)."""
        loaded = self.transfers.loaded
        while loaded and step.has_room_for_another() and len(self.running) < self.max_num_seqs:
            request = loaded[0]
            num_computed = request.num_computed_tokens
            num_new_tokens = min(request.num_tokens - num_computed, step.token_budget)
            lookahead = self.drafts.num_lookahead(num_computed + num_new_tokens)
            kv = self.kv_cache_manager
            if kv.allocate_slots(request, num_new_tokens, num_lookahead_tokens=lookahead) is None:
                return
            loaded.pop(0)
            block_ids = kv.get_block_ids(request.request_id)
            step.new_reqs.append(self._start_running(request, block_ids, num_computed))
            step.schedule(request.request_id, num_new_tokens)

    def _start_running(
        self, request: Request, block_ids: list[int], num_hit_tokens: int
    ) -> NewRequestData:
        """Move an admitted request into ``running``; what the runner gets of it."""
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit_tokens
        if request.num_cached_tokens < 0:  # first scheduled (not resumed)
            request.num_cached_tokens = num_hit_tokens
            request.scheduled_time = time.time()
        keys = self._keys
        bisect.insort(self.running, request, key=lambda r: keys[r.request_id])
        return NewRequestData(
            req_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=list(request.output_token_ids),
            sampling_params=request.sampling_params,
            block_ids=block_ids,
            num_computed_tokens=num_hit_tokens,
            lora_request=request.lora_request,
            pooling_params=request.pooling_params,
        )

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Apply the step's sampled tokens.

        Returns:
            An ``EngineCoreOutput`` per request that got a token or finished (ignored requests
            included), and the ``SchedulerStats``.

        Side effects: advances ``num_computed_tokens``; appends tokens; frees finished requests;
        finishes the requests the step failed (``failed_requests``) with finish reason "error".
        Requests finished while the step ran (aborted) are skipped.
        """
        if model_runner_output.kv_connector_output is not None:
            self._apply_transfers(model_runner_output.kv_connector_output)
        if model_runner_output.failed_requests or self._grammar_errors:
            self._fail_requests({**model_runner_output.failed_requests, **self._grammar_errors})
            self._grammar_errors.clear()
        outputs = list(self._ignored.values())
        self._ignored.clear()
        self.pipeline.finish(scheduler_output.num_scheduled_tokens)
        has_finished = False
        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            output = self._apply_step(request, num_tokens, scheduler_output, model_runner_output)
            if output is not None:
                outputs.append(output)
                has_finished |= request.status != RequestStatus.RUNNING
        if has_finished:
            self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]
        if self._grammar_errors:  # raised by a grammar while taking this step's tokens
            self._fail_requests(self._grammar_errors)
            self._grammar_errors.clear()
            outputs.extend(self._ignored.values())
            self._ignored.clear()
        return EngineCoreOutputs(
            outputs=outputs, scheduler_stats=self.make_stats(), timestamp=time.monotonic()
        )

    def _apply_step(
        self,
        request: Request,
        num_tokens: int,
        scheduler_output: SchedulerOutput,
        model_runner_output: ModelRunnerOutput,
    ) -> EngineCoreOutput | None:
        """Apply the step to one running request that it scheduled ``num_tokens``: its output,
        or None when it got no token (a partial prefill chunk) or its grammar raised (failed by
        the caller). Side effects: advances and appends; frees it when it stopped."""
        request.num_computed_tokens += num_tokens
        request_id = request.request_id
        index = model_runner_output.req_id_to_index.get(request_id)
        if index is None or request.num_computed_tokens < request.num_tokens:
            return None  # A partial prefill chunk samples nothing.
        if request.pooling_params is not None:
            return self._finish_pooling(request, model_runner_output.pooler_output[request_id])
        new_token_ids = model_runner_output.sampled_token_ids[index]
        if not new_token_ids:
            return None
        drafts = scheduler_output.scheduled_spec_decode_tokens.get(request_id)
        if drafts:
            self.drafts.take_back_rejected(request, len(drafts), len(new_token_ids))
        is_first_output = request.num_output_tokens == 0
        # A prefill recomputed after a preemption computes prompt logprobs again: sent once.
        prompt_logprobs = model_runner_output.prompt_logprobs_dict
        prompt = prompt_logprobs.get(request_id) if is_first_output else None
        new_token_ids, is_stopped = self._append_tokens(request, new_token_ids)
        if request_id in self._grammar_errors:
            return None  # failed by the caller, with no output of this step's tokens
        new_logprobs = model_runner_output.logprobs.get(request_id)
        if new_logprobs is not None and len(new_logprobs.logprobs) > len(new_token_ids):
            new_logprobs = new_logprobs.slice(0, len(new_token_ids))
        if not is_stopped and model_runner_output.spec_token_ids:
            request.spec_token_ids = allowed_drafts(
                request, model_runner_output.spec_token_ids[index], self._grammar_errors
            )
        output = EngineCoreOutput(
            request_id,
            new_token_ids,
            new_logprobs=new_logprobs,
            new_prompt_logprobs=prompt,
            finish_reason=request.get_finished_reason() if is_stopped else None,
            stop_reason=request.stop_reason,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            scheduled_time=request.scheduled_time if is_first_output else 0.0,
        )
        if is_stopped:
            output.kv_transfer_params = self._free_request(request)
        return output

    def _finish_pooling(self, request: Request, pooled: bytes) -> EngineCoreOutput:
        """A pooling request's prompt is computed: it finishes (stopped) with its vector and no
        tokens; frees it."""
        request.status = RequestStatus.FINISHED_STOPPED
        output = EngineCoreOutput(
            request.request_id,
            [],
            finish_reason=FinishReason.STOP,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            scheduled_time=request.scheduled_time,
            pooled=pooled,
        )
        self._free_request(request)
        return output

    def _append_tokens(self, request: Request, new_token_ids: list[int]) -> tuple[list[int], bool]:
        """Append the step's tokens to ``request`` up to a stop; advances its grammar. Returns
        the tokens taken and whether it stopped (not when its grammar raised: see
        ``accept_token``)."""
        for i, token_id in enumerate(new_token_ids):
            request.output_token_ids.append(token_id)
            if request.matcher is not None and not accept_token(
                request, token_id, self._grammar_errors
            ):
                break  # its grammar raised: failed by the caller, before it can stop
            if request.check_stop(self.max_model_len):
                return new_token_ids[: i + 1], True
        return new_token_ids, False

    def make_stats(self) -> SchedulerStats:
        """Current counts, plus prefix-cache and preemption numbers since the last call."""
        prefix_stats = self.kv_cache_manager.take_prefix_cache_stats()
        num_preemptions, self._num_preemptions = self._num_preemptions, 0
        num_drafts, num_draft_tokens, num_accepted = self.drafts.take_stats()
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting) + self.transfers.num_waiting,
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=prefix_stats.num_queries,
            prefix_cache_hits=prefix_stats.num_hits,
            num_preemptions=num_preemptions,
            spec_num_drafts=num_drafts,
            spec_num_draft_tokens=num_draft_tokens,
            spec_num_accepted_tokens=num_accepted,
            kv_connector_stats=self.transfers.take_stats(),
        )

    # -- internals -----------------------------------------------------------------------------

    def _admit_ready_grammars(self) -> None:
        """Queue the requests whose grammar compiled; finish those whose compile failed or ran
        past ``max_compile_seconds`` with finish reason "error" (the message in ``stop_reason``)."""
        if not self.waiting_for_grammar:
            return
        is_idle = not self.running and not self.waiting
        ready, failed = self.waiting_for_grammar.take_done(is_idle)
        for request in ready:
            request.status = RequestStatus.WAITING
            self.waiting.add(request, self._keys[request.request_id])
        for request, error in failed:
            self._fail(request, error)

    def _fail_requests(self, errors: dict[str, str]) -> None:
        """Finish the running requests that failed in the step (``ModelRunnerOutput.
        failed_requests``) with finish reason "error". The step's blocks of each leave the
        prefix cache: they do not hold what their hashes say."""
        for request_id, error in errors.items():
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # finished while the step ran
            self.kv_cache_manager.uncache(request, request.num_computed_tokens)
            self._fail(request, error)
        self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]

    def _fail(self, request: Request, error: str) -> None:
        """Finish ``request`` with finish reason "error" and ``error`` in ``stop_reason`` (its
        output goes out with the next ``update_from_output``); frees its blocks."""
        logger.error("request %s failed: %s", request.request_id, error)
        request.status = RequestStatus.FINISHED_ERROR
        self._ignored[request.request_id] = EngineCoreOutput(
            request.request_id, [], finish_reason=FinishReason.ERROR, stop_reason=error
        )
        self._free_request(request)

    def _preempt(self, request: Request, reason: str = "out of KV-cache blocks") -> None:
        """Free a running request's blocks and queue it again, to recompute from scratch."""
        self.kv_cache_manager.free(request)
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self._num_preemptions += 1
        self.waiting.add(request, self._keys[request.request_id])
        self.finished_req_ids.add(request.request_id)
        logger.warning(
            "request %s preempted (%s; %d preemptions); it will be recomputed",
            request.request_id,
            reason,
            request.num_preemptions,
        )

    def _apply_transfers(self, report: KVConnectorOutput) -> None:
        """The connector's report (``KVTransfers.apply``): a request whose load failed is
        recomputed (preempted: the step's token, made from wrong KV, is dropped) or, with
        ``kv_load_failure_policy`` "fail", finished with finish reason "error"."""
        running = [r for r in self.running if r.request_id not in self.in_flight]
        failed = self.transfers.apply(report, running)
        for request in failed:
            reason = "its KV-cache blocks failed to load"
            if self.transfers.fail_on_load_error:
                self._fail(request, KV_LOAD_FAILED)
            elif request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self._requeue_after_failed_load(request)
            else:
                self._preempt(request, reason)
        self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]

    def _requeue_after_failed_load(self, request: Request) -> None:
        """A request whose asynchronous load failed (it never ran): queued again, to compute its
        prompt after its local hit (its blocks freed: the hit is found again at admission)."""
        logger.warning(
            "request %s: its KV-cache blocks failed to load; it will be recomputed",
            request.request_id,
        )
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        self.waiting.add(request, self._keys[request.request_id])

    def _free_request(self, request: Request) -> dict | None:
        """Free ``request``'s blocks (or leave them to the KV connector) and forget it. Returns
        the connector's ``kv_transfer_params`` for its client."""
        request_id = request.request_id
        params = self.transfers.release(request)
        del self.requests[request_id]
        del self._keys[request_id]
        self.finished_req_ids.add(request_id)
        return params
