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
latencies and token counts) for the caller's metrics; times are wall-clock (``time.time()``, the
clock of ``EngineCoreRequest.arrival_time``).

What it must not know: scheduling, the KV cache, the model. The engine core knows nothing about
text: stop strings and detokenization live here only.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from kiln.engine.detokenizer import IncrementalDetokenizer, make_decode_fn
from kiln.messages import EngineCoreOutput, EngineCoreRequest, FinishReason, LogprobsLists
from kiln.outputs import (
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    SampleLogprobs,
)
from kiln.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class FinishedRequestStats:
    """One finished engine-core request, for the e2e-latency and finish-reason metrics."""

    request_id: str
    finish_reason: FinishReason
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    time_to_first_token: float | None
    mean_inter_token_latency: float | None


@dataclass
class IterationStats:
    """What one ``process_outputs`` call saw, ready to feed into Prometheus counters/histograms."""

    iteration_timestamp: float
    num_prompt_tokens: int = 0
    """Prompt tokens of the requests that got their first token in this iteration."""
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    reqs_to_abort: list[str]
    """Requests a stop string finished that the engine core still runs: the caller aborts them."""
    iteration_stats: IterationStats | None = None


class _TokenTexts:
    """Token id -> its text alone, cached (special tokens kept, as vLLM's decoded_token)."""

    def __init__(self, tokenizer: Any) -> None:
        self._decode = make_decode_fn(tokenizer, skip_special_tokens=False)
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._decode([token_id])
        return text


def make_position_logprobs(
    lists: LogprobsLists, num_logprobs: int, token_text: Callable[[int], str] | None
) -> list[PositionLogprobs]:
    """Per-position dicts from ``LogprobsLists``: column 0's token (with its rank), then the top
    ``num_logprobs`` (ranks 1..k). A column-0 token that is also in the top-k appears once."""
    positions = []
    for token_ids, logprobs, rank in zip(
        lists.logprob_token_ids, lists.logprobs, lists.sampled_token_ranks, strict=True
    ):
        ranks = [rank, *range(1, num_logprobs + 1)]
        positions.append(
            {
                token_id: Logprob(logprob, r, None if token_text is None else token_text(token_id))
                for token_id, logprob, r in zip(token_ids, logprobs, ranks, strict=False)
            }
        )
    return positions


class _SendsPromptLogprobsOnce:
    """DELTA outputs carry the prompt logprobs once, in the first output that has them."""

    output_kind: RequestOutputKind
    _prompt_logprobs_sent: bool

    def _prompt_logprobs_once(
        self, prompt_logprobs: PromptLogprobs | None
    ) -> PromptLogprobs | None:
        if self.output_kind == RequestOutputKind.DELTA and prompt_logprobs is not None:
            if self._prompt_logprobs_sent:
                return None
            self._prompt_logprobs_sent = True
        return prompt_logprobs


class ParentRequest(_SendsPromptLogprobsOnce):
    """Gathers the ``n`` child requests of one ``n > 1`` request into one ``RequestOutput``.

    Children are engine-core requests with ids ``f"{index}_{request_id}"`` (see
    ``kiln.engine.input_processor.fan_out``); each is registered by ``OutputProcessor.add_request``.
    """

    def __init__(self, request_id: str, sampling_params: SamplingParams) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.n = sampling_params.n
        self.output_kind = sampling_params.output_kind
        self.child_request_ids: set[str] = set()
        """Children that are still running."""
        self._completions = [
            CompletionOutput(index=i, text="", token_ids=[]) for i in range(self.n)
        ]
        self._new_indices: set[int] = set()
        self._num_finished = 0
        self._children: list[_RequestState] = []
        self._prompt_logprobs_sent = False

    @property
    def finished(self) -> bool:
        return self._num_finished == self.n

    @property
    def first_child(self) -> _RequestState:
        return self._children[0]

    def completion(self, index: int) -> CompletionOutput:
        """The latest completion output of child ``index`` (empty before its first)."""
        return self._completions[index]

    def add_child(self, child: _RequestState) -> None:
        self.child_request_ids.add(child.request_id)
        self._children.append(child)

    def add_child_output(self, completion: CompletionOutput | None, finished: bool) -> None:
        if finished:
            self._num_finished += 1
        if completion is not None:
            self._completions[completion.index] = completion
            self._new_indices.add(completion.index)

    def make_request_output(self) -> RequestOutput | None:
        """The parent's output for this iteration, or None when it has nothing to send."""
        new_indices, self._new_indices = sorted(self._new_indices), set()
        if self.output_kind == RequestOutputKind.FINAL_ONLY and not self.finished:
            return None
        if self.output_kind == RequestOutputKind.DELTA:
            outputs = [self._completions[i] for i in new_indices]
        else:
            outputs = list(self._completions)
        if not outputs:
            return None
        first = self._children[0]
        prompt_logprobs = next(
            (c.prompt_logprobs for c in self._children if c.prompt_logprobs is not None), None
        )
        prompt_logprobs = self._prompt_logprobs_once(prompt_logprobs)
        return RequestOutput(
            request_id=self.request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=outputs,
            finished=self.finished,
            num_cached_tokens=first.num_cached_tokens,
            metrics=_merge_metrics([c.metrics for c in self._children], self.finished),
        )


def _merge_metrics(metrics: list[RequestMetrics], finished: bool) -> RequestMetrics:
    """A parent's metrics: first arrival and first token, last token, tokens summed."""
    first_token_times = [m.first_token_time for m in metrics if m.first_token_time is not None]
    last_token_times = [m.last_token_time for m in metrics if m.last_token_time is not None]
    return RequestMetrics(
        arrival_time=min(m.arrival_time for m in metrics),
        first_token_time=min(first_token_times, default=None),
        last_token_time=max(last_token_times, default=None),
        finished_time=max(m.finished_time or 0.0 for m in metrics) if finished else None,
        num_generation_tokens=sum(m.num_generation_tokens for m in metrics),
    )


class _RequestState(_SendsPromptLogprobsOnce):
    """One engine-core request as the front end tracks it."""

    def __init__(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        parent: ParentRequest | None,
        index: int,
        tokenizer: Any,
        token_text: Callable[[int], str] | None,
    ) -> None:
        params = request.sampling_params
        self.request_id = request.request_id
        self.prompt = prompt
        self.prompt_token_ids = request.prompt_token_ids
        self.parent = parent
        self.index = index
        self.output_kind = params.output_kind
        self.num_logprobs = params.logprobs
        self.num_prompt_logprobs = params.prompt_logprobs
        self.detokenizer = (
            IncrementalDetokenizer(tokenizer, params, request.prompt_token_ids)
            if params.detokenize and tokenizer is not None
            else None
        )
        self.token_text = token_text if self.detokenizer is not None else None
        self.token_ids: list[int] = []
        self.logprobs: SampleLogprobs | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.prompt_logprobs: PromptLogprobs | None = None
        self._prompt_logprobs_sent = False
        self._num_sent_tokens = 0
        self.latest: CompletionOutput | None = None
        """The last completion output made (for the abort output)."""
        self.num_cached_tokens = 0
        self.metrics = RequestMetrics(arrival_time=request.arrival_time)

    def add_logprobs(self, output: EngineCoreOutput) -> None:
        if self.logprobs is not None and output.new_logprobs is not None:
            assert self.num_logprobs is not None and self.cumulative_logprob is not None
            lists = output.new_logprobs
            self.logprobs.extend(make_position_logprobs(lists, self.num_logprobs, self.token_text))
            self.cumulative_logprob += sum(row[0] for row in lists.logprobs)
        if self.num_prompt_logprobs is not None and output.new_prompt_logprobs is not None:
            if self.prompt_logprobs is None:
                self.prompt_logprobs = [None]  # The first prompt token has no logprob.
            self.prompt_logprobs.extend(
                make_position_logprobs(
                    output.new_prompt_logprobs, self.num_prompt_logprobs, self.token_text
                )
            )

    def make_completion_output(
        self, finish_reason: FinishReason | None, stop_reason: int | str | None
    ) -> CompletionOutput | None:
        finished = finish_reason is not None
        if self.output_kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = self.output_kind == RequestOutputKind.DELTA
        text = (
            ""
            if self.detokenizer is None
            else self.detokenizer.get_next_output_text(finished, delta)
        )
        start = self._num_sent_tokens if delta else 0
        self._num_sent_tokens = len(self.token_ids)
        self.latest = CompletionOutput(
            index=self.index,
            text=text,
            token_ids=self.token_ids[start:],
            cumulative_logprob=self.cumulative_logprob,
            logprobs=None if self.logprobs is None else self.logprobs[start:],
            finish_reason=None if finish_reason is None else str(finish_reason),
            stop_reason=stop_reason,
        )
        return self.latest

    def make_request_output(self, completion: CompletionOutput, finished: bool) -> RequestOutput:
        prompt_logprobs = self._prompt_logprobs_once(self.prompt_logprobs)
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=[completion],
            finished=finished,
            num_cached_tokens=self.num_cached_tokens,
            metrics=self.metrics,
        )


class OutputProcessor:
    """Turns engine-core outputs into ``RequestOutput`` s for the requests it was given.

    Args:
        tokenizer: a Kiln ``Tokenizer`` (or an HF tokenizer); None when the engine returns token
            ids only (requests then get no text).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._token_text = None if tokenizer is None else _TokenTexts(tokenizer)
        self.request_states: dict[str, _RequestState] = {}
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
        state = _RequestState(
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
            latest = {state.index: parent.completion(state.index) for state in states}
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
            state.add_logprobs(output)
            finish_reason, stop_reason = output.finish_reason, output.stop_reason
            if state.detokenizer is not None:
                stop_str = state.detokenizer.update(
                    output.new_token_ids,
                    stop_terminated=finish_reason == FinishReason.STOP,
                    finished=finish_reason is not None,
                )
                if stop_str is not None:
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
        self, state: _RequestState, finish_reason: FinishReason, stats: IterationStats, now: float
    ) -> None:
        del self.request_states[state.request_id]
        if state.parent is not None:
            state.parent.child_request_ids.discard(state.request_id)
        self._record_finished(state, finish_reason, stats, now)

    @staticmethod
    def _record_finished(
        state: _RequestState, finish_reason: FinishReason, stats: IterationStats, now: float
    ) -> None:
        metrics = state.metrics
        metrics.finished_time = now
        stats.finished_requests.append(
            FinishedRequestStats(
                request_id=state.request_id,
                finish_reason=finish_reason,
                e2e_latency=now - metrics.arrival_time,
                num_prompt_tokens=len(state.prompt_token_ids),
                num_generation_tokens=metrics.num_generation_tokens,
                time_to_first_token=metrics.time_to_first_token,
                mean_inter_token_latency=metrics.mean_inter_token_latency,
            )
        )

    @staticmethod
    def _update_stats(
        state: _RequestState, output: EngineCoreOutput, stats: IterationStats, now: float
    ) -> None:
        num_new_tokens = len(output.new_token_ids)
        if num_new_tokens == 0:
            return
        metrics = state.metrics
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


__all__ = [
    "FinishedRequestStats",
    "IterationStats",
    "OutputProcessor",
    "ParentRequest",
    "ProcessedOutputs",
    "make_position_logprobs",
]
