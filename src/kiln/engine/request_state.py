"""What the front end keeps per request between engine steps, for ``OutputProcessor``.

``RequestState`` is one engine-core request: its incremental detokenizer (text and stop strings),
its logprob dicts and metrics, and the ``CompletionOutput`` / ``RequestOutput`` it makes each step
in its output kind. ``ParentRequest`` gathers the ``n`` children of an ``n > 1`` request into one
``RequestOutput``, completions in index order. Both send the prompt logprobs once in DELTA mode.
"""

from __future__ import annotations

from collections.abc import Callable
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


class TokenTexts:
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
        self._children: list[RequestState] = []
        self._prompt_logprobs_sent = False

    @property
    def finished(self) -> bool:
        return self._num_finished == self.n

    @property
    def first_child(self) -> RequestState:
        return self._children[0]

    @property
    def max_num_generation_tokens(self) -> int:
        """The most tokens one child generated so far."""
        return max(c.metrics.num_generation_tokens for c in self._children)

    def completion(self, index: int) -> CompletionOutput:
        """The latest completion output of child ``index`` (empty before its first)."""
        return self._completions[index]

    def add_child(self, child: RequestState) -> None:
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
    """A parent's metrics: first arrival, scheduling and first token, last token, tokens
    summed."""
    scheduled_times = [m.scheduled_time for m in metrics if m.scheduled_time is not None]
    first_token_times = [m.first_token_time for m in metrics if m.first_token_time is not None]
    last_token_times = [m.last_token_time for m in metrics if m.last_token_time is not None]
    return RequestMetrics(
        arrival_time=min(m.arrival_time for m in metrics),
        scheduled_time=min(scheduled_times, default=None),
        first_token_time=min(first_token_times, default=None),
        last_token_time=max(last_token_times, default=None),
        finished_time=max(m.finished_time or 0.0 for m in metrics) if finished else None,
        num_generation_tokens=sum(m.num_generation_tokens for m in metrics),
    )


class RequestState(_SendsPromptLogprobsOnce):
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
        self.max_tokens = params.max_tokens
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
        self.pooled: bytes | None = None
        self.kv_transfer_params: dict[str, Any] | None = None
        """The KV connector's answer with the finished request (``EngineCoreOutput``)."""
        """A pooling request's vector, once its output came."""
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

    def drop_last_tokens(self, num_tokens: int) -> None:
        """Forget the last ``num_tokens`` output tokens (and their logprobs): they came after a
        stop string in the same step."""
        if num_tokens <= 0:
            return
        dropped = self.token_ids[-num_tokens:]
        del self.token_ids[-num_tokens:]
        if self.logprobs is not None and len(self.logprobs) >= num_tokens:
            assert self.cumulative_logprob is not None
            positions = self.logprobs[-num_tokens:]
            del self.logprobs[-num_tokens:]
            self.cumulative_logprob -= sum(
                position[token_id].logprob
                for token_id, position in zip(dropped, positions, strict=True)
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
            pooled=self.pooled,
            kv_transfer_params=self.kv_transfer_params,
        )
