"""``POST /v1/completions``, shaped as OpenAI's (with vLLM's ``stop_reason`` and
``prompt_logprobs``).

Response (non-streaming)::

    {"id": "cmpl-...", "object": "text_completion", "created", "model",
     "choices": [{"index", "text", "logprobs", "finish_reason", "stop_reason"}, ...],
     "usage": {"prompt_tokens", "completion_tokens", "total_tokens"}}

``logprobs`` is null or ``{"text_offset", "token_logprobs", "tokens", "top_logprobs"}``; with
``echo`` it covers the prompt too, its first entry null (the first token has no logprob). Choice
``index`` is ``prompt_index * n + completion_index``. Streaming sends ``text_completion`` chunks
with the same fields (``text`` is the new text), one ``finish_reason`` per choice, with
``stream_options.include_usage`` a last chunk with ``choices: []`` and ``usage``, then
``data: [DONE]``. A KV connector's ``kv_transfer_params`` (``collect``: on the response) ride
on each choice's last chunk, the one with its ``finish_reason``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from kiln.entrypoints.openai.errors import OpenAIError
from kiln.entrypoints.openai.protocol import CompletionRequest
from kiln.entrypoints.openai.serving_engine import OpenAIServing, Prompt, clamp, usage
from kiln.entrypoints.openai.streams import sse
from kiln.outputs import CompletionOutput, PositionLogprobs, PromptLogprobs, RequestOutput


@dataclass
class _Choice:
    """One completion as it accumulates (non-streaming) or streams."""

    token_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    num_chars: int = 0
    """Characters sent so far (the next ``text_offset``)."""
    started: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class OpenAIServingCompletion(OpenAIServing):
    request_fields = frozenset(CompletionRequest.model_fields)

    async def create(self, request: CompletionRequest, raw: Request) -> Response:
        lora_request = self.check_model(request.model)
        self.note_unknown_fields(request)
        if request.suffix is not None:
            raise OpenAIError("suffix is not currently supported", param="suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise OpenAIError("best_of other than n is not supported", param="best_of")
        if request.prompt_logprobs is not None and request.stream:
            raise OpenAIError(
                "`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs"
            )
        max_tokens = 16 if request.max_tokens is None else request.max_tokens
        if max_tokens < 0 or (max_tokens == 0 and not request.echo):
            raise OpenAIError(
                f"max_tokens must be at least 1 (0 only with echo), got {max_tokens}.",
                param="max_tokens",
            )
        # echo with max_tokens=0 returns the prompt only; the engine still makes one token.
        echo_only = request.echo and max_tokens == 0
        prompt_logprobs = request.prompt_logprobs
        if request.echo and request.logprobs is not None:
            prompt_logprobs = max(prompt_logprobs or 0, request.logprobs)
        params = self.sampling_params(
            request,
            max_tokens=max(max_tokens, 1),
            logprobs=request.logprobs,
            prompt_logprobs=prompt_logprobs,
        )
        self.check_ready()
        prompts = await self._prompts(request)
        request_id = self.make_request_id("cmpl", request, raw)
        engine_requests = self.process(request_id, prompts, params, request.priority, lora_request)
        self.check_response_size(engine_requests, echo=request.echo)
        for prompt, engine_request in zip(prompts, engine_requests, strict=True):
            if len(engine_request.prompt_token_ids) < len(prompt.token_ids):
                # truncate_prompt_tokens: usage and echo are of what the model saw.
                prompt.token_ids, prompt.text = engine_request.prompt_token_ids, None
        if request.echo:
            for prompt in prompts:
                if prompt.text is None:
                    prompt.text = await self.run_in_worker(
                        self.tokenizer.decode, prompt.token_ids, False
                    )
        self.check_ready()
        ids, outputs = self.generate(engine_requests)
        model = self.model_name(lora_request)
        run = _Run(self, request, request_id, prompts, echo_only, model)
        if request.stream:
            return self.stream(ids, run.stream(outputs))
        return await self.respond(raw, ids, run.collect(outputs))

    async def _prompts(self, request: CompletionRequest) -> list[Prompt]:
        # An empty prompt (none, "", [], [[]], a text of no tokens) is the input processor's to
        # refuse (EMPTY_PROMPT), like every other admission rule.
        prompt = "" if request.prompt is None else request.prompt
        if isinstance(prompt, str):
            items: list[str | list[int]] = [prompt]
        elif all(isinstance(x, int) for x in prompt):
            items = [prompt]  # type: ignore[list-item]
        else:
            items = list(prompt)  # type: ignore[arg-type]
        prompts = []
        for item in items:
            if isinstance(item, str):
                token_ids = await self.encode(item, request.add_special_tokens) if item else []
                prompts.append(Prompt(token_ids, item))
            else:
                prompts.append(Prompt(list(item)))
        return prompts


class _Run:
    """One completion request in flight: turns engine outputs into the response or its chunks."""

    def __init__(
        self,
        serving: OpenAIServingCompletion,
        request: CompletionRequest,
        request_id: str,
        prompts: list[Prompt],
        echo_only: bool,
        model: str,
    ) -> None:
        self.serving = serving
        self.model = model
        """The response's ``model`` (the adapter's name for a LoRA request)."""
        self.request = request
        self.request_id = request_id
        self.prompts = prompts
        self.echo_only = echo_only
        self.n = request.n
        self.created = int(time.time())
        self.choices = [_Choice() for _ in range(len(prompts) * request.n)]
        self.prompt_logprobs: list[PromptLogprobs | None] = [None] * len(prompts)
        self.prompt_token_ids: list[list[int]] = [p.token_ids for p in prompts]

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _usage(self) -> dict[str, int]:
        num_prompt = sum(len(ids) for ids in self.prompt_token_ids)
        return usage(num_prompt, sum(len(c.token_ids) for c in self.choices))

    def _take(
        self, prompt_index: int, output: RequestOutput, completion: CompletionOutput
    ) -> tuple[_Choice, str, list[int], list[PositionLogprobs | None] | None, str | None]:
        """Fold one delta into its choice. Returns the choice and what to send: text, token ids,
        per-position logprobs (None entries: prompt positions without one) and finish_reason."""
        if output.prompt_logprobs is not None:
            self.prompt_logprobs[prompt_index] = output.prompt_logprobs
        choice = self.choices[prompt_index * self.n + completion.index]
        text, token_ids = completion.text, completion.token_ids
        positions: list[PositionLogprobs | None] | None = (
            None if completion.logprobs is None else list(completion.logprobs)
        )
        finish_reason = completion.finish_reason
        if self.echo_only:
            text, token_ids, positions = "", [], [] if positions is not None else None
            if finish_reason is not None and finish_reason != "abort":
                finish_reason = "length"
        else:
            choice.token_ids.extend(token_ids)
            choice.texts.append(text)
            if completion.logprobs is not None:
                choice.logprobs.extend(completion.logprobs)
        if finish_reason is not None:
            choice.finish_reason = finish_reason
            choice.stop_reason = None if self.echo_only else completion.stop_reason
        if self.request.echo and not choice.started:
            prompt = self.prompts[prompt_index]
            text = (prompt.text or "") + text
            if positions is not None:
                echoed = self.prompt_logprobs[prompt_index] or [None] * len(prompt.token_ids)
                positions = [*echoed, *positions]
            token_ids = [*prompt.token_ids, *token_ids]
        choice.started = True
        return choice, text, token_ids, positions, finish_reason

    def _logprobs(
        self,
        choice: _Choice,
        token_ids: list[int],
        positions: list[PositionLogprobs | None],
    ) -> dict[str, Any]:
        """OpenAI's completion logprobs of ``token_ids``, offsets continuing the choice's text."""
        serving = self.serving
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top_logprobs: list[dict[str, float] | None] = []
        text_offset: list[int] = []
        for token_id, position in zip(token_ids, positions, strict=True):
            if position is None:
                token = serving.token_text(token_id)
                token_logprobs.append(None)
                top_logprobs.append(None)
            else:
                token = serving.logprob_token(token_id, position)
                token_logprobs.append(clamp(position[token_id].logprob))
                top_logprobs.append(
                    {
                        serving.logprob_token(t, position): clamp(p.logprob)
                        for t, p in position.items()
                    }
                )
            tokens.append(token)
            text_offset.append(choice.num_chars)
            choice.num_chars += len(token)
        return {
            "text_offset": text_offset,
            "token_logprobs": token_logprobs,
            "tokens": tokens,
            "top_logprobs": top_logprobs,
        }

    async def stream(
        self, outputs: AsyncIterator[tuple[int, RequestOutput]]
    ) -> AsyncIterator[bytes]:
        options = self.request.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = bool(options and options.continuous_usage_stats)
        async for prompt_index, output in outputs:
            for completion in output.outputs:
                choice, text, token_ids, positions, finish_reason = self._take(
                    prompt_index, output, completion
                )
                if not text and not token_ids and finish_reason is None:
                    continue
                logprobs = None
                if positions is not None:
                    logprobs = self._logprobs(choice, token_ids, positions)
                data = {
                    "index": prompt_index * self.n + completion.index,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": finish_reason,
                    "stop_reason": choice.stop_reason if finish_reason else None,
                }
                if self.request.return_token_ids:
                    data["token_ids"] = completion.token_ids
                chunk = self._envelope([data])
                if include_usage:
                    chunk["usage"] = self._usage() if continuous else None
                # The connector's answer rides on the choice's last chunk, as on the response.
                if finish_reason is not None and output.kv_transfer_params:
                    chunk["kv_transfer_params"] = output.kv_transfer_params
                yield sse(chunk)
        if include_usage:
            yield sse({**self._envelope([]), "usage": self._usage()})

    async def collect(self, outputs: AsyncIterator[tuple[int, RequestOutput]]) -> dict[str, Any]:
        kv_transfer_params = None
        async for prompt_index, output in outputs:
            kv_transfer_params = output.kv_transfer_params or kv_transfer_params
            for completion in output.outputs:
                self._take(prompt_index, output, completion)
        choices = []
        for index, choice in enumerate(self.choices):
            prompt_index = index // self.n
            prompt = self.prompts[prompt_index]
            text = "".join(choice.texts)
            token_ids = list(choice.token_ids)
            positions: list[PositionLogprobs | None] = list(choice.logprobs)
            if self.request.echo:
                text = (prompt.text or "") + text
                echoed = self.prompt_logprobs[prompt_index] or [None] * len(prompt.token_ids)
                positions = [*echoed, *positions]
                token_ids = [*prompt.token_ids, *token_ids]
            data: dict[str, Any] = {
                "index": index,
                "text": text,
                "logprobs": (
                    None
                    if self.request.logprobs is None
                    else self._logprobs(choice, token_ids, positions)
                ),
                "finish_reason": choice.finish_reason,
                "stop_reason": choice.stop_reason,
            }
            if self.request.prompt_logprobs is not None:
                data["prompt_logprobs"] = _vllm_prompt_logprobs(self.prompt_logprobs[prompt_index])
            if self.request.return_token_ids:
                data["prompt_token_ids"] = prompt.token_ids
                data["token_ids"] = choice.token_ids
            choices.append(data)
        response = {**self._envelope(choices), "usage": self._usage()}
        if kv_transfer_params is not None:
            response["kv_transfer_params"] = kv_transfer_params
        return response


def _vllm_prompt_logprobs(prompt_logprobs: PromptLogprobs | None) -> list[Any] | None:
    """vLLM's ``prompt_logprobs``: per position null or ``{token_id: {logprob, rank,
    decoded_token}}``."""
    if prompt_logprobs is None:
        return None
    return [
        None
        if position is None
        else {
            str(token_id): {
                "logprob": clamp(lp.logprob),
                "rank": lp.rank,
                "decoded_token": lp.decoded_token,
            }
            for token_id, lp in position.items()
        }
        for position in prompt_logprobs
    ]


__all__ = ["OpenAIServingCompletion"]
