"""The front end's output side: engine-core outputs (token ids) -> ``RequestOutput`` s (text).

Contract: ``OutputProcessor.process_outputs`` takes the ``EngineCoreOutput`` s of one engine step
and, for each live request, decodes the new tokens incrementally, applies stop strings (a match
finishes the request with finish_reason ``"stop"`` and stop_reason the string, and its id goes into
``reqs_to_abort`` so the caller aborts it in the engine core), converts logprobs to per-position
dicts, and builds the ``RequestOutput`` its output kind asks for: CUMULATIVE (everything so far),
DELTA (only what is new) or FINAL_ONLY (once, when finished). Children of an ``n > 1`` request
are gathered into one ``RequestOutput`` of their ``ParentRequest``, completions in index order.
``make_abort_output`` builds the last output of a request aborted from outside (its unfinished
completions with finish_reason ``"abort"``), so every ``RequestOutput`` is made here.
Each call also returns an ``IterationStats`` (TTFT, inter-token latencies, finished requests'
latencies, their queue / prefill / decode split and token counts) for the caller's metrics;
times are wall-clock (``time.time()``, the clock of ``EngineCoreRequest.arrival_time`` and of
``EngineCoreOutput.scheduled_time``).

What it must not know: scheduling, the KV cache, the model. The engine core knows nothing about
text: stop strings and detokenization live here only.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kiln.engine.request_state import ParentRequest, RequestState, TokenTexts
from kiln.engine.stats import FinishedRequestStats, IterationStats
from kiln.messages import EngineCoreOutput, EngineCoreRequest, FinishReason
from kiln.outputs import CompletionOutput, RequestOutput
from kiln.sampling_params import RequestOutputKind


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    reqs_to_abort: list[str]
    """Requests a stop string finished that the engine core still runs: the caller aborts them."""
    iteration_stats: IterationStats | None = None


class OutputProcessor:
    """Turns engine-core outputs into ``RequestOutput`` s for the requests it was given.

    Args:
        tokenizer: a Kiln ``Tokenizer`` (or an HF tokenizer); None when the engine returns token
            ids only (requests then get no text).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._token_text = None if tokenizer is None else TokenTexts(tokenizer)
        self.request_states: dict[str, RequestState] = {}
        self.parent_requests: dict[str, ParentRequest] = {}

    def add_request(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        parent_request: ParentRequest | None = None,
        index: int = 0,
    ) -> None:
        """Start tracking ``request`` (a child of ``parent_request`` at ``index`` when n > 1).

        Raises:
            ValueError: a request with the same id is already tracked.
        """
        request_id = request.request_id
        if request_id in self.request_states:
            raise ValueError(f"request_id {request_id!r} is already running")
        state = RequestState(
            request, prompt, parent_request, index, self.tokenizer, self._token_text
        )
        self.request_states[request_id] = state
        if parent_request is not None:
            self.parent_requests[parent_request.request_id] = parent_request
            parent_request.add_child(state)

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def make_abort_output(self, request_id: str) -> RequestOutput | None:
        """The last output of ``request_id`` (or of a parent of ``n > 1`` requests) when it is
        aborted now: each unfinished completion with finish_reason ``"abort"``, empty in DELTA
        mode and as last sent otherwise (empty in FINAL_ONLY mode, which sent nothing). None when
        the request is not tracked (it finished). Call before ``abort_requests``.
        """
        parent = self.parent_requests.get(request_id)
        if parent is not None:
            states = [self.request_states[child_id] for child_id in parent.child_request_ids]
            latest: dict[int, CompletionOutput | None] = {
                state.index: parent.completion(state.index) for state in states
            }
        elif request_id in self.request_states:
            states = [self.request_states[request_id]]
            latest = {states[0].index: states[0].latest}
        else:
            return None
        first = states[0] if parent is None else parent.first_child
        outputs = [
            dataclasses.replace(completion, finish_reason="abort")
            if completion is not None and first.output_kind != RequestOutputKind.DELTA
            else CompletionOutput(index=index, text="", token_ids=[], finish_reason="abort")
            for index, completion in sorted(latest.items())
        ]
        return RequestOutput(
            request_id=request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            prompt_logprobs=None,
            outputs=outputs,
            finished=True,
        )

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)

    def abort_requests(
        self,
        request_ids: Iterable[str],
        stats: IterationStats | None = None,
        finish_reason: FinishReason = FinishReason.ABORT,
    ) -> list[str]:
        """Stop tracking requests (parent ids abort all their children); no output is made.

        Args:
            request_ids: requests (or parents of ``n > 1`` requests) to stop tracking.
            stats: where to count each engine-core request stopped as finished with
                ``finish_reason``; None: not counted.

        Returns:
            The engine-core request ids that were tracked, for the caller to abort in the core.
        """
        aborted = []
        for request_id in request_ids:
            parent = self.parent_requests.pop(request_id, None)
            child_ids = sorted(parent.child_request_ids) if parent is not None else [request_id]
            for child_id in child_ids:
                state = self.request_states.pop(child_id, None)
                if state is None:
                    continue
                aborted.append(child_id)
                if stats is not None:
                    self._record_finished(state, finish_reason, stats, stats.iteration_timestamp)
                if state.parent is not None:
                    state.parent.child_request_ids.discard(child_id)
                    state.parent.add_child_output(None, finished=True)
                    if not state.parent.child_request_ids:
                        self.parent_requests.pop(state.parent.request_id, None)
        return aborted

    def process_outputs(
        self, engine_core_outputs: list[EngineCoreOutput], now: float | None = None
    ) -> ProcessedOutputs:
        """Process one engine step's outputs (see the module docstring).

        Outputs for requests that are not tracked (aborted meanwhile) are ignored.

        Side effects: finished requests stop being tracked.
        """
        now = time.time() if now is None else now
        stats = IterationStats(iteration_timestamp=now)
        # Request id -> its RequestOutput, or its ParentRequest to build once all children are in.
        ordered: dict[str, RequestOutput | ParentRequest] = {}
        reqs_to_abort: list[str] = []
        for output in engine_core_outputs:
            state = self.request_states.get(output.request_id)
            if state is None:
                continue
            self._update_stats(state, output, stats, now)
            state.num_cached_tokens = output.num_cached_tokens or state.num_cached_tokens
            state.token_ids.extend(output.new_token_ids)
            state.pooled = output.pooled
            if output.kv_transfer_params is not None:
                state.kv_transfer_params = output.kv_transfer_params
            state.add_logprobs(output)
            finish_reason, stop_reason = output.finish_reason, output.stop_reason
            if state.detokenizer is not None:
                stop_str = state.detokenizer.update(
                    output.new_token_ids,
                    stop_terminated=finish_reason == FinishReason.STOP,
                    finished=finish_reason is not None,
                )
                if stop_str is not None:
                    state.drop_last_tokens(state.detokenizer.num_tokens_after_stop)
                    finish_reason, stop_reason = FinishReason.STOP, stop_str
                    if not output.finished:
                        reqs_to_abort.append(output.request_id)
            finished = finish_reason is not None
            if finish_reason is not None:
                self._finish(state, finish_reason, stats, now)
            completion = state.make_completion_output(finish_reason, stop_reason)
            if state.parent is None:
                if completion is not None:
                    ordered[state.request_id] = state.make_request_output(completion, finished)
            else:
                state.parent.add_child_output(completion, finished)
                ordered[state.parent.request_id] = state.parent
        request_outputs = []
        for item in ordered.values():
            if isinstance(item, ParentRequest):
                if item.finished:
                    self.parent_requests.pop(item.request_id, None)
                parent_output = item.make_request_output()
                if parent_output is not None:
                    request_outputs.append(parent_output)
            else:
                request_outputs.append(item)
        return ProcessedOutputs(request_outputs, reqs_to_abort, stats)

    def _finish(
        self, state: RequestState, finish_reason: FinishReason, stats: IterationStats, now: float
    ) -> None:
        del self.request_states[state.request_id]
        self._record_finished(state, finish_reason, stats, now)
        if state.parent is not None:
            state.parent.child_request_ids.discard(state.request_id)

    @staticmethod
    def _record_finished(
        state: RequestState, finish_reason: FinishReason, stats: IterationStats, now: float
    ) -> None:
        """Count ``state`` as finished (and its client request, when it was the last of them).
        Call before it leaves its parent's ``child_request_ids``."""
        metrics = state.metrics
        metrics.finished_time = now
        # Each phase ends where the next begins, or at the finish when it was never reached.
        scheduled = metrics.scheduled_time or now
        first_token = metrics.first_token_time or now
        last_token = metrics.last_token_time or now
        stats.finished_requests.append(
            FinishedRequestStats(
                request_id=state.request_id,
                finish_reason=finish_reason,
                e2e_latency=now - metrics.arrival_time,
                num_prompt_tokens=len(state.prompt_token_ids),
                num_generation_tokens=metrics.num_generation_tokens,
                time_to_first_token=metrics.time_to_first_token,
                mean_inter_token_latency=metrics.mean_inter_token_latency,
                queued_time=max(0.0, scheduled - metrics.arrival_time),
                prefill_time=max(0.0, first_token - scheduled),
                decode_time=max(0.0, last_token - first_token),
                inference_time=max(0.0, last_token - scheduled),
                max_tokens_param=state.max_tokens,
            )
        )
        parent = state.parent
        if parent is None:
            stats.max_num_generation_tokens.append(metrics.num_generation_tokens)
            stats.n_params.append(1)
        elif parent.child_request_ids <= {state.request_id}:
            stats.max_num_generation_tokens.append(parent.max_num_generation_tokens)
            stats.n_params.append(parent.n)

    @staticmethod
    def _update_stats(
        state: RequestState, output: EngineCoreOutput, stats: IterationStats, now: float
    ) -> None:
        metrics = state.metrics
        if output.scheduled_time:
            metrics.scheduled_time = output.scheduled_time
        num_new_tokens = len(output.new_token_ids)
        if output.pooled is not None:  # a pooling request: its prompt computed, no token
            stats.num_prompt_tokens += len(state.prompt_token_ids)
        if num_new_tokens == 0:
            return
        stats.num_generation_tokens += num_new_tokens
        if metrics.first_token_time is None:
            metrics.first_token_time = now
            stats.num_prompt_tokens += len(state.prompt_token_ids)
            stats.time_to_first_tokens.append(now - metrics.arrival_time)
        else:
            assert metrics.last_token_time is not None
            stats.inter_token_latencies.append(now - metrics.last_token_time)
        metrics.last_token_time = now
        metrics.num_generation_tokens += num_new_tokens


__all__ = ["OutputProcessor", "ProcessedOutputs"]
