"""``/v1/responses``: OpenAI's Responses API, served by the chat route.

A request becomes a chat request (``responses_items``: input items -> messages, flat function
tools -> chat tools, ``text.format`` -> ``response_format``), which runs through
``OpenAIServingChat.start`` (its template, tool-call and reasoning parsing, structured outputs,
admission); the chat answer becomes the response object, or, streaming, its chunks become the
typed events (``responses_stream``).

Response (non-streaming)::

    {"id": "resp_...", "object": "response", "created_at", "status": "completed" | "incomplete"
     | "cancelled", "incomplete_details": null | {"reason": "max_output_tokens"}, "model",
     "output": [reasoning | message | function_call items], "usage": {"input_tokens",
     "input_tokens_details", "output_tokens", "output_tokens_details", "total_tokens"},
     the request's instructions, max_output_tokens, metadata, tools, tool_choice, temperature,
     top_p, text, reasoning, store, previous_response_id, user, parallel_tool_calls, ...}

Routes: ``POST /v1/responses``, ``GET /v1/responses/{id}``, ``GET
/v1/responses/{id}/input_items``, ``DELETE /v1/responses/{id}``, ``POST
/v1/responses/{id}/cancel``. With ``store`` (the default) a response is kept in the
``ResponseStore`` of its API key (see ``namespace``) while it runs and after; ``cancel`` aborts
one in progress (its engine requests, freeing their KV blocks) and answers it ``cancelled``; a
finished one cannot be cancelled (400). ``previous_response_id`` continues a stored
conversation: its items (input and output) come before the new input; an unknown (or expired,
or another key's) id is a 404.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from starlette.responses import Response

from kiln.entrypoints.openai.errors import OpenAIError
from kiln.entrypoints.openai.protocol_responses import MAX_INPUT_ITEMS, ResponsesRequest
from kiln.entrypoints.openai.responses_items import (
    chat_param,
    check_request,
    echo_tool_choice,
    input_items,
    new_id,
    output_items,
    status_of,
    to_chat_request,
    to_messages,
    usage_of,
)
from kiln.entrypoints.openai.responses_store import ResponseStore
from kiln.entrypoints.openai.responses_stream import ResponseEvents, response_events, sse_event
from kiln.entrypoints.openai.serving_chat import ChatRun, OpenAIServingChat
from kiln.entrypoints.openai.serving_engine import OpenAIServing, ServerState
from kiln.outputs import RequestOutput

DEFAULT_LIST_LIMIT = 20
MAX_LIST_LIMIT = 100
"""``GET /v1/responses/{id}/input_items``' page sizes (OpenAI's)."""


def namespace(raw: Request, has_api_keys: bool) -> str:
    """The store namespace of a request: a digest of its API key (the middleware has checked
    it), or one namespace for all when the server has no keys."""
    if not has_api_keys:
        return ""
    return hashlib.sha256(raw.headers.get("authorization", "").encode()).hexdigest()


def _not_found(response_id: str, param: str = "response_id") -> OpenAIError:
    return OpenAIError(f"Response with id '{response_id}' not found.", 404, param=param)


def _status_of_failure(exc: BaseException) -> str:
    return "cancelled" if isinstance(exc, asyncio.CancelledError) else "failed"


@dataclass
class _Kept:
    """Where a response in progress is kept: the store (None: ``store: false``), its namespace,
    and what its stored versions share."""

    store: ResponseStore | None
    space: str
    skeleton: dict[str, Any]
    conversation: list[dict[str, Any]]

    def keep(self, response: dict[str, Any]) -> None:
        """Store ``response`` (this one's latest version) with the conversation it ends."""
        if self.store is not None:
            self.store.put(self.space, response, [*self.conversation, *response["output"]])


class OpenAIServingResponses(OpenAIServing):
    request_fields = frozenset(ResponsesRequest.model_fields)

    def __init__(self, state: ServerState, chat: OpenAIServingChat) -> None:
        super().__init__(state)
        self.chat = chat
        options = state.options
        self.store = ResponseStore(
            options.responses_store_max_entries,
            options.responses_store_max_bytes,
            options.responses_store_ttl,
        )

    async def create(self, request: ResponsesRequest, raw: Request, space: str) -> Response:
        self.note_unknown_fields(request)
        check_request(request)
        conversation = input_items(request)
        if request.previous_response_id is not None:
            previous = self.store.get(space, request.previous_response_id)
            if previous is None:
                raise _not_found(request.previous_response_id, "previous_response_id")
            if previous.response["status"] == "in_progress":
                raise OpenAIError(
                    f"Previous response '{request.previous_response_id}' is still in progress.",
                    param="previous_response_id",
                )
            conversation = [*previous.conversation, *conversation]
        if len(conversation) > MAX_INPUT_ITEMS:
            raise OpenAIError(
                f"the conversation (input and previous_response_id's) holds {len(conversation)} "
                f"items, more than this server's limit of {MAX_INPUT_ITEMS}",
                param="input",
            )
        messages = to_messages(conversation, request.instructions)
        chat_request = to_chat_request(request, messages, request.stream)
        response_id = new_id("resp")
        try:
            ids, run, outputs = await self.chat.start(chat_request, response_id)
        except OpenAIError as exc:
            exc.param = chat_param(exc.param)
            raise
        skeleton = self._skeleton(request, response_id, run.model)
        kept = _Kept(self.store if request.store else None, space, skeleton, conversation)
        if kept.store is not None:
            kept.store.put(space, skeleton, conversation, ids)
        if request.stream:
            return self.stream(ids, self._stream(kept, run, outputs), framed=False)
        return await self.respond(raw, ids, self._collect(kept, run, outputs))

    def _skeleton(self, request: ResponsesRequest, response_id: str, model: str) -> dict[str, Any]:
        """The response object before its output: status ``in_progress``, the request echoed."""
        text = request.text or {"format": {"type": "text"}}
        reasoning = request.reasoning or {}
        return {
            "id": response_id,
            "object": "response",
            "created_at": int(time.time()),
            "status": "in_progress",
            "background": False,
            "error": None,
            "incomplete_details": None,
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "metadata": request.metadata or {},
            "model": model,
            "output": [],
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": request.previous_response_id,
            "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
            "store": request.store,
            "temperature": 1.0 if request.temperature is None else request.temperature,
            "text": text,
            "tool_choice": echo_tool_choice(request.tool_choice, bool(request.tools)),
            "tools": request.tools or [],
            "top_p": 1.0 if request.top_p is None else request.top_p,
            "truncation": "disabled",
            "usage": None,
            "user": request.user,
        }

    async def _collect(
        self, kept: _Kept, run: ChatRun, outputs: AsyncIterator[tuple[int, RequestOutput]]
    ) -> dict[str, Any]:
        try:
            chat = await run.collect(outputs)
        except BaseException as exc:  # the client left, or the engine failed
            kept.keep({**kept.skeleton, "status": _status_of_failure(exc)})
            raise
        (choice,) = chat["choices"]
        status, details = status_of(choice["finish_reason"])
        response = {
            **kept.skeleton,
            "status": status,
            "incomplete_details": details,
            "output": output_items(choice["message"], status),
            "usage": usage_of(chat["usage"], run.num_cached_tokens),
        }
        kept.keep(response)
        return response

    async def _stream(
        self, kept: _Kept, run: ChatRun, outputs: AsyncIterator[tuple[int, RequestOutput]]
    ) -> AsyncIterator[bytes]:
        events = ResponseEvents(kept.skeleton, lambda: run.num_cached_tokens)
        finished = False
        try:
            async for event in response_events(events, run.chunks(outputs)):
                if event["type"] in ("response.completed", "response.incomplete"):
                    kept.keep(event["response"])
                    finished = True
                elif event["type"] == "error":
                    kept.keep({**kept.skeleton, "status": "failed"})
                    finished = True
                yield sse_event(event)
        finally:
            if not finished:  # the client left
                kept.keep({**kept.skeleton, "status": "cancelled"})

    # -- stored responses -----------------------------------------------------------------------

    def retrieve(self, space: str, response_id: str) -> dict[str, Any]:
        entry = self.store.get(space, response_id)
        if entry is None:
            raise _not_found(response_id)
        return entry.response

    def list_input_items(
        self, space: str, response_id: str, limit: int, order: str, after: str | None
    ) -> dict[str, Any]:
        """A page of the items the response was given (previous ones included), as OpenAI
        lists them: ``order`` ``desc`` (the default) or ``asc``, ``limit`` 1-100, ``after`` an
        item id.

        Raises:
            OpenAIError: 404 for an unknown response, 400 for a bad ``limit``, ``order`` or
                ``after``.
        """
        entry = self.store.get(space, response_id)
        if entry is None:
            raise _not_found(response_id)
        if not 1 <= limit <= MAX_LIST_LIMIT:
            raise OpenAIError(f"limit must be in [1, {MAX_LIST_LIMIT}], got {limit}", param="limit")
        if order not in ("asc", "desc"):
            raise OpenAIError(f"order must be 'asc' or 'desc', got {order!r}", param="order")
        num_inputs = len(entry.conversation) - len(entry.response["output"])
        items = entry.conversation[:num_inputs]
        if order == "desc":
            items = items[::-1]
        if after is not None:
            ids = [item.get("id") for item in items]
            if after not in ids:
                raise OpenAIError(f"no input item has id {after!r}", param="after")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0].get("id") if page else None,
            "last_id": page[-1].get("id") if page else None,
            "has_more": len(items) > limit,
        }

    def delete(self, space: str, response_id: str) -> dict[str, Any]:
        if not self.store.delete(space, response_id):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    async def cancel(self, space: str, response_id: str) -> dict[str, Any]:
        """Abort a response in progress (its KV blocks are freed) and answer it ``cancelled``.

        Raises:
            OpenAIError: 404 for an unknown id; 400 for a response that has finished.
        """
        entry = self.store.get(space, response_id)
        if entry is None:
            raise _not_found(response_id)
        status = entry.response["status"]
        if status != "in_progress":
            raise OpenAIError(
                f"Cannot cancel response '{response_id}': its status is {status!r}; only a "
                "response in progress can be cancelled.",
                param="response_id",
            )
        for request_id in entry.engine_request_ids:
            await self.llm.abort(request_id)
        entry.response = {**entry.response, "status": "cancelled"}
        return entry.response


def add_responses_routes(app: FastAPI, serving: OpenAIServingResponses, has_keys: bool) -> None:
    """Register the ``/v1/responses`` routes on ``app``."""

    @app.post("/v1/responses")
    async def create_response(request: ResponsesRequest, raw: Request) -> Response:
        return await serving.create(request, raw, namespace(raw, has_keys))

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, raw: Request) -> Response:
        return _json(serving.retrieve(namespace(raw, has_keys), response_id))

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(
        response_id: str,
        raw: Request,
        limit: int = DEFAULT_LIST_LIMIT,
        order: str = "desc",
        after: str | None = None,
    ) -> Response:
        space = namespace(raw, has_keys)
        return _json(serving.list_input_items(space, response_id, limit, order, after))

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, raw: Request) -> Response:
        return _json(serving.delete(namespace(raw, has_keys), response_id))

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str, raw: Request) -> Response:
        return _json(await serving.cancel(namespace(raw, has_keys), response_id))


def _json(body: Any) -> Response:
    return Response(msgspec.json.encode(body), media_type="application/json")


__all__ = ["OpenAIServingResponses", "add_responses_routes", "namespace"]
