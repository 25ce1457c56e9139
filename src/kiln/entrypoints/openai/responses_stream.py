"""Streaming ``/v1/responses``: the chat route's chunks turned into the Responses API's typed
server-sent events, in the order the official SDK's stream state accepts.

Order: ``response.created``, ``response.in_progress``; then per output item
``response.output_item.added``, its pieces, ``response.output_item.done``; then
``response.completed``, or ``response.incomplete`` when ``max_output_tokens`` cut the answer or
it was cancelled (the response's ``status`` says which). Pieces: for a message
``response.content_part.added``, ``response.output_text.delta`` s, ``response.output_text.done``,
``response.content_part.done``; for a call ``response.function_call_arguments.delta`` s and
``.done``; for reasoning ``response.reasoning_text.delta`` s and ``.done``. Every event has a
``sequence_number`` from 0, and its ``type`` also as the SSE ``event:`` line (as OpenAI sends
them). An item stays open until a piece of another kind (or the end) closes it.

What it must not know: HTTP, the engine, the store.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from kiln.entrypoints.openai.errors import to_openai_error
from kiln.entrypoints.openai.responses_items import (
    function_call_item,
    message_item,
    new_id,
    output_text,
    reasoning_item,
    status_of,
    usage_of,
)


def sse_event(event: dict[str, Any]) -> bytes:
    """One event in OpenAI's framing: ``event: TYPE`` then ``data: JSON``."""
    return b"event: " + event["type"].encode() + b"\ndata: " + msgspec.json.encode(event) + b"\n\n"


class ResponseEvents:
    """One streamed response: fold chat chunks in (``take``), get the events to send."""

    def __init__(self, skeleton: dict[str, Any], num_cached_tokens: Callable[[], int]) -> None:
        self.skeleton = skeleton
        self.num_cached_tokens = num_cached_tokens
        """The prompt tokens the prefix cache held, known once the request has run."""
        """The response object without output (status ``in_progress``)."""
        self.sequence_number = 0
        self.items: list[dict[str, Any]] = []
        """The output items, in order (open ones still growing)."""
        self.open: list[int] = []
        """Indices in ``items`` of the items not closed yet."""
        self.calls: dict[int, int] = {}
        """Chat's tool-call index -> index in ``items``."""
        self.finish_reason: str | None = None
        self.usage: dict[str, int] | None = None

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        response = {**self.skeleton, "output": []}
        return [
            self._event("response.created", response=response),
            self._event("response.in_progress", response=response),
        ]

    def _open(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        index = len(self.items)
        self.items.append(item)
        self.open.append(index)
        added = {**item}
        if item["type"] in ("message", "reasoning"):
            added["content"] = []
        events = [self._event("response.output_item.added", output_index=index, item=added)]
        if item["type"] == "message":
            part = output_text("")
            events.append(
                self._event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=part,
                )
            )
        return events

    def _close_all(self, status: str) -> list[dict[str, Any]]:
        events = []
        for index in self.open:
            item = self.items[index]
            item["status"] = status if item["type"] != "reasoning" else "completed"
            ids = {"item_id": item["id"], "output_index": index}
            if item["type"] == "message":
                part = item["content"][0]
                text = part["text"]
                events.append(
                    self._event(
                        "response.output_text.done", **ids, content_index=0, text=text, logprobs=[]
                    )
                )
                events.append(
                    self._event("response.content_part.done", **ids, content_index=0, part=part)
                )
            elif item["type"] == "reasoning":
                text = item["content"][0]["text"]
                events.append(
                    self._event("response.reasoning_text.done", **ids, content_index=0, text=text)
                )
            else:
                events.append(
                    self._event(
                        "response.function_call_arguments.done",
                        **ids,
                        name=item["name"],
                        arguments=item["arguments"],
                    )
                )
            events.append(self._event("response.output_item.done", output_index=index, item=item))
        self.open = []
        return events

    def _current(self, kind: str) -> dict[str, Any] | None:
        if self.open and self.items[self.open[-1]]["type"] == kind:
            return self.items[self.open[-1]]
        return None

    def take(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """The events for one ``chat.completion.chunk`` (as an object)."""
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        events: list[dict[str, Any]] = []
        for choice in chunk["choices"]:
            delta = choice["delta"]
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
            if delta.get("reasoning_content"):
                events += self._text_delta("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                events += self._text_delta("message", delta["content"])
            for piece in delta.get("tool_calls") or ():
                events += self._call_piece(piece)
        return events

    def _text_delta(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = []
        item = self._current(kind)
        if item is None:
            events += self._close_all("completed")
            item = message_item("", "in_progress") if kind == "message" else reasoning_item("")
            events += self._open(item)
        item["content"][0]["text"] += text
        ids = {"item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0}
        if kind == "message":
            events.append(self._event("response.output_text.delta", **ids, delta=text, logprobs=[]))
        else:
            events.append(self._event("response.reasoning_text.delta", **ids, delta=text))
        return events

    def _call_piece(self, piece: dict[str, Any]) -> list[dict[str, Any]]:
        events = []
        function = piece.get("function") or {}
        arguments = function.get("arguments") or ""
        if piece.get("id") is not None:  # a new call: its first piece names it
            if self._current("function_call") is None:
                events += self._close_all("completed")
            item = function_call_item(piece["id"], function.get("name") or "", "", "in_progress")
            self.calls[piece["index"]] = len(self.items)
            events += self._open(item)
        index = self.calls.get(piece["index"])
        if index is None or not arguments:
            return events
        item = self.items[index]
        item["arguments"] += arguments
        events.append(
            self._event(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=index,
                delta=arguments,
            )
        )
        return events

    def final(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The whole response, and the events that end the stream (closing the open items,
        then ``response.completed`` or ``response.incomplete``)."""
        status, details = status_of(self.finish_reason)
        events = self._close_all("incomplete" if status != "completed" else "completed")
        if not self.items:  # an empty answer is still a message, as in the whole response
            events += self._open(message_item("", "in_progress"))
            events += self._close_all(status if status == "completed" else "incomplete")
        response = {
            **self.skeleton,
            "status": status,
            "incomplete_details": details,
            "output": self.items,
            "usage": usage_of(self.usage, self.num_cached_tokens()) if self.usage else None,
        }
        kind = "response.completed" if status == "completed" else "response.incomplete"
        events.append(self._event(kind, response=response))
        return response, events

    def error(self, exc: BaseException) -> dict[str, Any]:
        """The ``error`` event for a failure once the stream has started."""
        error = to_openai_error(exc)
        return self._event(
            "error", code=str(error.status_code), message=error.message, param=error.param
        )


async def response_events(
    events: ResponseEvents, chunks: AsyncIterator[dict[str, Any]]
) -> AsyncIterator[dict[str, Any]]:
    """All the events of a streamed response from its chat chunks; the last one (unless the
    chunks fail, which ends with an ``error`` event) carries the whole response."""
    for event in events.start():
        yield event
    try:
        async for chunk in chunks:
            for event in events.take(chunk):
                yield event
    except Exception as exc:
        yield events.error(exc)
        return
    _, last = events.final()
    for event in last:
        yield event


__all__ = ["ResponseEvents", "new_id", "response_events", "sse_event"]
