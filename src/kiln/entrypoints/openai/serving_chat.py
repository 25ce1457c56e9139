"""``POST /v1/chat/completions``, shaped as OpenAI's (with vLLM's ``stop_reason``).

Response (non-streaming)::

    {"id": "chatcmpl-...", "object": "chat.completion", "created", "model",
     "choices": [{"index", "message": {"role": "assistant", "content"}, "logprobs",
                  "finish_reason", "stop_reason"}, ...],
     "usage": {"prompt_tokens", "completion_tokens", "total_tokens"}}

``logprobs`` is null or ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``.
Streaming sends ``chat.completion.chunk`` s: first, per choice, a delta with the role
(``{"role": "assistant", "content": ""}``), then deltas with ``content``, the last one of each
choice carrying its ``finish_reason``; with ``stream_options.include_usage`` a last chunk with
``choices: []`` and ``usage``; then ``data: [DONE]``.

With tools or a reasoning parser (see ``chat_tools``), the message also has ``tool_calls`` (when
the model made calls; ``finish_reason`` is then ``tool_calls``) and ``reasoning_content`` (with
``--reasoning-parser``), and deltas carry ``tool_calls`` pieces and ``reasoning_content``.
``response_format`` (``json_schema``, ``json_object``) and ``structured_outputs`` are enforced while
sampling (``kiln.structured_output``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from kiln.entrypoints.openai.chat_tools import ChoiceParser, plan_tools
from kiln.entrypoints.openai.errors import OpenAIError
from kiln.entrypoints.openai.protocol import ChatCompletionRequest
from kiln.entrypoints.openai.serving_engine import OpenAIServing, clamp, usage
from kiln.entrypoints.openai.streams import sse
from kiln.outputs import PositionLogprobs, RequestOutput

logger = logging.getLogger(__name__)


class OpenAIServingChat(OpenAIServing):
    request_fields = frozenset(ChatCompletionRequest.model_fields)

    async def create(self, request: ChatCompletionRequest, raw: Request) -> Response:
        self.note_unknown_fields(request)
        request_id = self.make_request_id("chatcmpl", request, raw)
        ids, run, outputs = await self.start(request, request_id)
        if request.stream:
            return self.stream(ids, run.stream(outputs))
        return await self.respond(raw, ids, run.collect(outputs))

    async def start(
        self, request: ChatCompletionRequest, request_id: str
    ) -> tuple[list[str], ChatRun, AsyncIterator[tuple[int, RequestOutput]]]:
        """Check, render and admit ``request``: its engine request ids, the run that turns its
        outputs into the answer (``ChatRun.collect``, or ``ChatRun.chunks`` / ``stream``), and
        the outputs. The Responses route runs its chat requests through here too.

        Raises:
            OpenAIError: 4xx for a bad request, 503 when the engine cannot take it.
        """
        lora_request = self.check_model(request.model)
        tool_options = self.state.options.tools
        plan = plan_tools(request, tool_options)
        max_tokens = request.max_completion_tokens
        if max_tokens is None:
            max_tokens = request.max_tokens
        top_logprobs = request.top_logprobs or 0
        if top_logprobs < 0:
            raise OpenAIError("`top_logprobs` must be a positive value.", param="top_logprobs")
        if top_logprobs > 0 and not request.logprobs:
            raise OpenAIError(
                "when using `top_logprobs`, `logprobs` must be set to true.", param="top_logprobs"
            )
        params = self.sampling_params(
            request,
            max_tokens=max_tokens,
            logprobs=top_logprobs if request.logprobs else None,
        )
        if plan.structured_outputs is not None:
            params.structured_outputs = plan.structured_outputs
        template_kwargs = dict(request.chat_template_kwargs or {})
        if request.tools is not None:
            tools = [tool.model_dump(exclude_none=True) for tool in request.tools]
            template_kwargs.setdefault("tools", tools)
        self.check_ready()
        prompt = await self.render_chat(
            request.messages,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            add_special_tokens=request.add_special_tokens,
            chat_template=request.chat_template,
            chat_template_kwargs=template_kwargs,
        )
        engine_requests = self.process(request_id, [prompt], params, request.priority, lora_request)
        self.check_response_size(engine_requests)
        self.check_ready()
        ids, outputs = self.generate(engine_requests)
        model = self.model_name(lora_request)
        num_prompt_tokens = len(engine_requests[0].prompt_token_ids)  # after truncation
        run = ChatRun(self, request, request_id, num_prompt_tokens, top_logprobs, model)
        if plan.choice != "none" or tool_options.reasoning_parser is not None:
            run.parsers = [ChoiceParser(plan, tool_options) for _ in range(request.n)]
        return ids, run, outputs


class ChatRun:
    """One chat request in flight: turns engine outputs into the response or its chunks."""

    def __init__(
        self,
        serving: OpenAIServingChat,
        request: ChatCompletionRequest,
        request_id: str,
        num_prompt_tokens: int,
        top_logprobs: int,
        model: str,
    ) -> None:
        self.serving = serving
        self.model = model
        """The response's ``model`` (the adapter's name for a LoRA request)."""
        self.request = request
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.top_logprobs = top_logprobs
        self.created = int(time.time())
        n = request.n
        self.texts: list[list[str]] = [[] for _ in range(n)]
        self.num_tokens = [0] * n
        self.logprobs: list[list[dict[str, Any]]] = [[] for _ in range(n)]
        self.finish_reasons: list[str | None] = [None] * n
        self.stop_reasons: list[int | str | None] = [None] * n
        self.parsers: list[ChoiceParser] | None = None
        self.num_cached_tokens = 0
        """Prompt tokens found in the prefix cache (the Responses API reports them)."""
        """Per choice, with tools or a reasoning parser: content -> reasoning and tool calls."""
        self.is_streaming = bool(request.stream)

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _usage(self) -> dict[str, int]:
        return usage(self.num_prompt_tokens, sum(self.num_tokens))

    def _logprobs(
        self, token_ids: list[int], positions: list[PositionLogprobs]
    ) -> list[dict[str, Any]]:
        serving = self.serving
        content = []
        for token_id, position in zip(token_ids, positions, strict=True):
            token = serving.logprob_token(token_id, position)
            ranked = sorted(
                (lp.rank, t)
                for t, lp in position.items()
                if lp.rank and lp.rank <= self.top_logprobs
            )
            top = []
            for _, t in ranked:
                text = serving.logprob_token(t, position)
                top.append(
                    {
                        "token": text,
                        "logprob": clamp(position[t].logprob),
                        "bytes": list(text.encode("utf-8")),
                    }
                )
            content.append(
                {
                    "token": token,
                    "logprob": clamp(position[token_id].logprob),
                    "bytes": list(token.encode("utf-8")),
                    "top_logprobs": top,
                }
            )
        return content

    def _take(self, output: RequestOutput) -> list[dict[str, Any]]:
        """Fold one delta into the choices; returns the delta choices to stream."""
        self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
        choices = []
        for completion in output.outputs:
            i = completion.index
            self.texts[i].append(completion.text)
            self.num_tokens[i] += len(completion.token_ids)
            logprobs = None
            if completion.logprobs is not None:
                logprobs = self._logprobs(completion.token_ids, completion.logprobs)
                self.logprobs[i].extend(logprobs)
            finish_reason = completion.finish_reason
            if finish_reason is not None:
                self.finish_reasons[i] = finish_reason
                self.stop_reasons[i] = completion.stop_reason
            elif not completion.text and not completion.token_ids:
                continue
            if self.parsers is not None and self.is_streaming:
                delta = self._parsed_delta(i, completion.text, finish_reason)
                if not delta and finish_reason is None and logprobs is None:
                    continue  # all held back (a tag may be starting)
            elif completion.text or finish_reason is None:
                delta = {"content": completion.text}
            else:
                delta = {}
            choices.append(
                {
                    "index": i,
                    "delta": delta,
                    "logprobs": None if logprobs is None else {"content": logprobs},
                    "finish_reason": self._finish_reason(i, finish_reason),
                    "stop_reason": completion.stop_reason if finish_reason else None,
                }
            )
        return choices

    def _parsed_delta(self, i: int, text: str, finish_reason: str | None) -> dict[str, Any]:
        assert self.parsers is not None
        parser = self.parsers[i]
        delta = parser.feed(text)
        if finish_reason is not None:
            tail = parser.finish()
            delta.reasoning += tail.reasoning
            delta.content += tail.content
            delta.tool_calls += tail.tool_calls
        return delta.to_dict()

    def _finish_reason(self, i: int, engine_reason: str | None) -> str | None:
        if self.parsers is None:
            return engine_reason
        return self.parsers[i].finish_reason(engine_reason)

    async def chunks(
        self, outputs: AsyncIterator[tuple[int, RequestOutput]]
    ) -> AsyncIterator[dict[str, Any]]:
        """The ``chat.completion.chunk`` s of a streamed answer, as objects."""
        options = self.request.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = bool(options and options.continuous_usage_stats)

        def chunk(choice: dict[str, Any]) -> dict[str, Any]:
            data = self._chunk([choice])
            if include_usage:
                data["usage"] = self._usage() if continuous else None
            return data

        for i in range(self.request.n):
            role = {"role": "assistant", "content": ""}
            yield chunk({"index": i, "delta": role, "logprobs": None, "finish_reason": None})
        async for _, output in outputs:
            for choice in self._take(output):
                data = chunk(choice)
                # The connector's answer rides on the choice's last chunk, as on the response.
                if choice.get("finish_reason") is not None and output.kv_transfer_params:
                    data["kv_transfer_params"] = output.kv_transfer_params
                yield data
        if include_usage:
            yield {**self._chunk([]), "usage": self._usage()}

    async def stream(
        self, outputs: AsyncIterator[tuple[int, RequestOutput]]
    ) -> AsyncIterator[bytes]:
        """``chunks`` as SSE events."""
        async for chunk in self.chunks(outputs):
            yield sse(chunk)

    def _message(self, i: int) -> dict[str, Any]:
        text = "".join(self.texts[i])
        if self.parsers is None:
            return {"role": "assistant", "content": text}
        return self.parsers[i].message(text)

    async def collect(self, outputs: AsyncIterator[tuple[int, RequestOutput]]) -> dict[str, Any]:
        kv_transfer_params = None
        async for _, output in outputs:
            kv_transfer_params = output.kv_transfer_params or kv_transfer_params
            self._take(output)
        choices = [
            {
                "index": i,
                "message": self._message(i),  # first: it counts the calls finish_reason needs
                "logprobs": None if not self.request.logprobs else {"content": self.logprobs[i]},
                "finish_reason": self._finish_reason(i, self.finish_reasons[i]),
                "stop_reason": self.stop_reasons[i],
            }
            for i in range(self.request.n)
        ]
        response = {
            "id": self.request_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self._usage(),
        }
        if kv_transfer_params is not None:
            response["kv_transfer_params"] = kv_transfer_params
        return response


__all__ = ["ChatRun", "OpenAIServingChat"]
