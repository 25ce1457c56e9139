"""What the completion and chat routes share: model and readiness checks, tokenization, sampling
params from a request, admission through the input processor before anything runs, starting the
prompts' generators, and the JSON or SSE response (see ``streams``).

Contract: a request is checked completely before the engine sees it (so a bad request is a 4xx
even with ``stream: true``, before any byte of the stream), and admitted (or refused with a 503)
before its response starts. Each prompt is validated once, by the engine's input processor
(``process``), whose ``ValueError`` becomes the 400: the length and token-id rules live there, not
here. Then each processed request runs as one ``AsyncLLM.generate`` with
``RequestOutputKind.DELTA``, under an engine request id of its own (a client's ``request_id`` or
``X-Request-Id`` names the response, and two requests may share it). Tokenizing and chat
templates run in worker threads, never on the event loop, and a prompt too long to fit the
context in any tokenization is refused before it is tokenized. A client that disconnects cancels
its generators, which aborts the requests in the engine core and frees their KV blocks
(streaming: Starlette cancels the stream when the client disconnects; non-streaming:
``streams.run_or_abort`` watches the connection).

What it must not know: the engine's internals (it talks to ``AsyncLLM`` and its ``Frontend``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from kiln.engine.async_llm import QueueFullError
from kiln.engine.input_processor import PromptError
from kiln.entrypoints.openai.errors import OpenAIError, bad_request, to_openai_error
from kiln.entrypoints.openai.protocol import ChatMessage, OpenAIBaseModel
from kiln.entrypoints.openai.server_state import MAX_WARNED_FIELDS, ServerState
from kiln.entrypoints.openai.streams import merge_async_iterators, run_or_abort, sse_events
from kiln.lora.request import LoRARequest
from kiln.messages import EngineCoreRequest
from kiln.outputs import PositionLogprobs, RequestOutput
from kiln.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")

MIN_LOGPROB = -9999.0
"""Logprobs are clamped here (as vLLM), so -inf never reaches JSON."""
MAX_LOGGED_NAME_CHARS = 64


@dataclass
class Prompt:
    """One prompt, tokenized: ``text`` is None for a token-id prompt until ``echo`` decodes it."""

    token_ids: list[int]
    text: str | None = None

    def for_engine(self) -> dict[str, Any]:
        prompt: dict[str, Any] = {"prompt_token_ids": self.token_ids}
        if self.text is not None:
            prompt["prompt"] = self.text
        return prompt


def response_logprobs(request: EngineCoreRequest, echo: bool) -> int:
    """The most logprob values ``request``'s answer can hold: each of its ``n`` completions
    ``max_tokens`` positions of ``logprobs + 1`` values (the chosen token and the top ones), and
    the prompt's positions with ``prompt_logprobs + 1`` each, once per completion when echoed."""
    params = request.sampling_params
    total = 0
    if params.logprobs is not None:
        total += params.n * (params.max_tokens or 0) * (params.logprobs + 1)
    if params.prompt_logprobs is not None:
        copies = params.n if echo else 1
        total += copies * len(request.prompt_token_ids) * (params.prompt_logprobs + 1)
    return total


def clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
    }


def _cut_after_final_message(text: str, final: ChatMessage) -> str:
    """``continue_final_message``: the rendered text up to the end of the last message's content
    (dropping the end-of-turn the template wrote), so the model continues that message."""
    content = final.content if isinstance(final.content, str) else ""  # parts come joined
    for needle in (content, content.strip()):
        index = text.rfind(needle) if needle else -1
        if index >= 0:
            return text[: index + len(needle)]
    raise OpenAIError(
        "continue_final_message: the final message's content is not in the rendered template",
        param="messages",
    )


class OpenAIServing:
    """The base of the serving classes (one per route family)."""

    request_fields: frozenset[str] = frozenset()
    """Request fields a ``ValueError`` message may name (they become the error's ``param``)."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.llm = state.llm
        self.frontend = state.llm.frontend
        self.tokenizer = self.frontend.tokenizer
        self.max_model_len = self.frontend.max_model_len
        self._token_texts: dict[int, str] = {}

    # -- checks ---------------------------------------------------------------------------------

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter ``model`` names (None: the base model, or no ``model``).

        Raises:
            OpenAIError: 404 when ``model`` is neither the served model nor a loaded adapter;
                400 when the adapter's files no longer pass the check (removed or rewritten
                since it was loaded).
        """
        if model is None or model == self.state.model_name:
            return None
        lora_request = self.state.lora_requests.get(model)
        if lora_request is None:
            raise OpenAIError(f"The model `{model}` does not exist.", 404, param="model")
        self.check_lora(lora_request, "model")
        return lora_request

    def check_lora(self, lora_request: LoRARequest, param: str) -> None:
        """Raises a 400 naming ``param`` unless the engine can serve the adapter (its files are
        read again only when they changed; see ``kiln.lora.peft.AdapterChecker``)."""
        try:
            self.frontend.input_processor.check_lora(lora_request)
        except ValueError as exc:
            raise OpenAIError(str(exc), param=param) from None

    def model_name(self, lora_request: LoRARequest | None) -> str:
        """A response's ``model``: the adapter the request named, else the served model (as
        vLLM answers)."""
        return self.state.model_name if lora_request is None else lora_request.lora_name

    def check_ready(self) -> None:
        """Raises a 503 ``OpenAIError`` when the server cannot take a generation request now."""
        if self.state.draining:
            raise OpenAIError("The server is shutting down.", 503)
        if self.llm.is_dead:
            raise OpenAIError("The engine is not running; see the server log.", 503)
        if self.llm.is_queue_full():
            raise to_openai_error(QueueFullError("the waiting queue is full"))

    def note_unknown_fields(self, request: OpenAIBaseModel) -> None:
        """Unknown fields are accepted; each name is logged once, the first
        ``MAX_WARNED_FIELDS`` names only (clients can send any number of names)."""
        warned = self.state.warned_fields
        if len(warned) >= MAX_WARNED_FIELDS:
            return
        new = [name for name in request.unknown_fields() if name not in warned]
        new = new[: MAX_WARNED_FIELDS - len(warned)]
        if new:
            warned.update(new)
            shown = [name[:MAX_LOGGED_NAME_CHARS] for name in new]
            logger.warning("ignoring request field(s) this server does not use: %s", shown)

    @property
    def _prompt_param(self) -> str:
        return "messages" if "messages" in self.request_fields else "prompt"

    # -- building requests ----------------------------------------------------------------------

    async def run_in_worker(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a tokenizer thread: CPU work never runs on the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.state.executor, fn, *args)

    def check_text_length(self, text: str) -> None:
        """Raises the context-length 400 for a text that cannot fit the context however it
        tokenizes: no token covers more characters than the tokenizer's longest token, so this
        is decided without tokenizing."""
        limit = self.max_model_len
        if len(text) > limit * self.tokenizer.max_token_chars:
            raise OpenAIError(
                f"This model's maximum context length is {limit} tokens. However, your request's "
                f"text has {len(text)} characters, more than {limit} tokens can hold. Please "
                "reduce the length of the input messages.",
                param=self._prompt_param,
            )

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """``text``'s token ids, tokenized in a worker thread after the length bound."""
        self.check_text_length(text)
        return await self.run_in_worker(self.tokenizer.encode, text, add_special_tokens)

    def check_chat_template(
        self, chat_template: str | None, chat_template_kwargs: dict[str, Any] | None
    ) -> None:
        """Raises a 400 for a request-supplied template (``chat_template``, or one in
        ``chat_template_kwargs``) unless the operator allowed them."""
        given = chat_template is not None or "chat_template" in (chat_template_kwargs or {})
        if given and not self.state.options.trust_request_chat_template:
            raise OpenAIError(
                "Chat template is passed with request, but --trust-request-chat-template is not "
                "set. Refused request with untrusted chat template.",
                param="chat_template",
            )

    async def render_chat(
        self,
        messages: list[ChatMessage],
        *,
        add_generation_prompt: bool,
        continue_final_message: bool,
        add_special_tokens: bool,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> Prompt:
        """The conversation rendered with the chat template, and tokenized.

        Raises:
            OpenAIError: 400 when the template rejects the messages, or the result is empty.
        """
        if add_generation_prompt and continue_final_message:
            raise OpenAIError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                param="continue_final_message",
            )
        self.check_chat_template(chat_template, chat_template_kwargs)
        kwargs = dict(chat_template_kwargs or {})
        chat_template = kwargs.pop("chat_template", chat_template)

        def render() -> str:
            return self.frontend.render_chat(
                [message.model_dump() for message in messages],
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
                chat_template_kwargs=kwargs,
            )

        try:
            text = await self.run_in_worker(render)
        except ValueError as exc:
            error = bad_request(exc, self.request_fields)
            error.param = error.param or "messages"
            raise error from None
        if continue_final_message:
            text = _cut_after_final_message(text, messages[-1])
        token_ids = await self.encode(text, add_special_tokens)
        if not token_ids:
            raise OpenAIError("the rendered conversation is empty", param="messages")
        return Prompt(token_ids, text)

    def sampling_params(
        self,
        request: Any,
        *,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """SamplingParams from the fields completions and chat share.

        Raises:
            OpenAIError: 400 for any value ``SamplingParams`` rejects.
        """
        max_n = self.state.options.max_n
        if request.n > max_n:
            raise OpenAIError(f"n must be at most {max_n}, got {request.n}", param="n")
        logit_bias = None
        if request.logit_bias:
            # vLLM clamps to OpenAI's range instead of refusing.
            logit_bias = {k: min(100.0, max(-100.0, v)) for k, v in request.logit_bias.items()}
        try:
            return SamplingParams(
                n=request.n,
                temperature=1.0 if request.temperature is None else request.temperature,
                top_p=1.0 if request.top_p is None else request.top_p,
                top_k=0 if request.top_k is None else request.top_k,
                min_p=0.0 if request.min_p is None else request.min_p,
                presence_penalty=request.presence_penalty or 0.0,
                frequency_penalty=request.frequency_penalty or 0.0,
                repetition_penalty=(
                    1.0 if request.repetition_penalty is None else request.repetition_penalty
                ),
                seed=request.seed,
                stop=request.stop,
                stop_token_ids=request.stop_token_ids,
                ignore_eos=request.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=request.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=request.skip_special_tokens,
                spaces_between_special_tokens=request.spaces_between_special_tokens,
                include_stop_str_in_output=request.include_stop_str_in_output,
                logit_bias=logit_bias,
                allowed_token_ids=request.allowed_token_ids,
                bad_words=request.bad_words,
                truncate_prompt_tokens=request.truncate_prompt_tokens,
                output_kind=RequestOutputKind.DELTA,
                structured_outputs=request.structured_outputs_params(),
                extra_args=(
                    None
                    if request.kv_transfer_params is None
                    else {"kv_transfer_params": request.kv_transfer_params}
                ),
            )
        except ValueError as exc:
            raise bad_request(exc, self.request_fields) from None

    def process(
        self,
        request_id: str,
        prompts: list[Prompt],
        params: SamplingParams,
        priority: int,
        lora_request: LoRARequest | None = None,
    ) -> list[EngineCoreRequest]:
        """Each prompt validated by the input processor, as the engine request it runs as (a 400
        before any byte is sent). The engine ids derive from ``request_id`` and are unique even
        when clients reuse it.

        Raises:
            OpenAIError: 400 with the input processor's message for anything it refuses.
        """
        base = f"{request_id}-{uuid.uuid4().hex[:8]}"
        ids = [base] if len(prompts) == 1 else [f"{base}-{i}" for i in range(len(prompts))]
        process = self.frontend.input_processor.process
        requests = []
        for index, (rid, prompt) in enumerate(zip(ids, prompts, strict=True)):
            try:
                requests.append(
                    process(
                        rid,
                        prompt.for_engine(),
                        params,
                        None,
                        priority,
                        prompt_name=f"prompt {index}",
                        lora_request=lora_request,
                    )
                )
            except ValueError as exc:
                raise self.input_error(exc) from None
        return requests

    def check_response_size(self, requests: list[EngineCoreRequest], echo: bool = False) -> None:
        """Refuse requests whose response could hold more than ``max_response_logprobs``
        logprob values (``response_logprobs``).

        Raises:
            OpenAIError: 400 naming the fields that make the response large.
        """
        limit = self.state.options.max_response_logprobs
        total = sum(response_logprobs(r, echo) for r in requests)
        if total > limit:
            fields = ["n", "max_tokens", "logprobs", "top_logprobs", "prompt_logprobs", "echo"]
            raise OpenAIError(
                f"the response could hold {total:,} logprob values (n x positions x (1 + top "
                f"logprobs), over {len(requests)} prompt(s)), more than this server's limit of "
                f"{limit:,}; lower any of {', '.join(fields)}",
                param="logprobs",
            )

    def input_error(self, exc: ValueError) -> OpenAIError:
        """The 400 for the input processor's ``exc``; a ``PromptError`` about the prompt names
        this route's prompt field (``prompt`` or ``messages``)."""
        error = bad_request(exc, self.request_fields)
        if isinstance(exc, PromptError):
            error.param = self._prompt_param if exc.param == "prompt" else exc.param
        return error

    @staticmethod
    def make_request_id(prefix: str, request: Any, raw: Request) -> str:
        """The response's ``id``: the client's ``request_id`` or ``X-Request-Id``, else random."""
        given = request.request_id or raw.headers.get("x-request-id")
        return f"{prefix}-{given or uuid.uuid4().hex}"

    # -- running --------------------------------------------------------------------------------

    def generate(
        self, requests: list[EngineCoreRequest]
    ) -> tuple[list[str], AsyncIterator[tuple[int, RequestOutput]]]:
        """Admit the ``process``ed ``requests`` now; returns their engine request ids and merged
        outputs (``(prompt index, output)``).

        Raises:
            OpenAIError: 503 when the waiting queue is full or the engine is dead; nothing of
                this request stays admitted.
        """
        ids = [request.request_id for request in requests]
        generators: list[AsyncIterator[RequestOutput]] = []
        try:
            for request in requests:
                generators.append(
                    self.llm.generate(request, request.sampling_params, request.request_id)
                )
        except Exception as exc:
            for rid in ids[: len(generators)]:
                self.llm.release(rid)
            raise to_openai_error(exc) from None
        return ids, merge_async_iterators(generators)

    @contextlib.contextmanager
    def tracked(self, request_ids: list[str]) -> Iterator[None]:
        """Count the requests as in flight (shutdown waits for them, then aborts them)."""
        self.state.active_request_ids.update(request_ids)
        try:
            yield
        finally:
            self.state.active_request_ids.difference_update(request_ids)

    async def respond(self, raw: Request, request_ids: list[str], work: Awaitable[Any]) -> Response:
        """The JSON response of a non-streaming generation (aborted if the client leaves)."""
        with self.tracked(request_ids):
            try:
                body = await run_or_abort(raw, work)
            except Exception as exc:
                raise to_openai_error(exc) from exc
        if body is None:
            return Response(status_code=499)  # nobody is listening
        return Response(msgspec.json.encode(body), media_type="application/json")

    def stream(
        self, request_ids: list[str], chunks: AsyncIterator[bytes], framed: bool = True
    ) -> StreamingResponse:
        """An SSE response: the events of ``chunks``, an error event if they fail, then
        ``data: [DONE]``; with ``framed`` false, ``chunks`` as they are (they end and report
        errors themselves)."""

        async def events() -> AsyncIterator[bytes]:
            with self.tracked(request_ids):
                async for event in sse_events(chunks) if framed else chunks:
                    yield event

        return StreamingResponse(
            events(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    # -- logprobs -------------------------------------------------------------------------------

    def token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode(
                [token_id], skip_special_tokens=False
            )
        return text

    def logprob_token(self, token_id: int, position: PositionLogprobs) -> str:
        decoded = position[token_id].decoded_token
        return self.token_text(token_id) if decoded is None else decoded


__all__ = ["OpenAIServing", "Prompt", "ServerState", "clamp", "usage"]
