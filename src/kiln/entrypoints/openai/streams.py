"""Streams of a request: merging the outputs of several prompts, SSE framing, and abandoning the
work when the client disconnects.

Contract: ``merge_async_iterators`` yields items as they come and, when closed or cancelled,
cancels the iterators still running (for ``AsyncLLM.generate`` that aborts the request);
``sse_events`` frames a stream as OpenAI's SSE (an error becomes an error event, since the status
is already 200) ending with ``data: [DONE]``; ``run_or_abort`` runs a non-streaming generation
unless the client disconnects first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import msgspec
from starlette.requests import Request

from kiln.entrypoints.openai.errors import sse_error, to_openai_error

logger = logging.getLogger(__name__)

T = TypeVar("T")

SSE_DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


async def sse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The events of ``chunks``; if they fail, an error event (the HTTP status is already 200);
    then ``data: [DONE]``."""
    try:
        async for chunk in chunks:
            yield chunk
    except Exception as exc:
        yield sse_error(to_openai_error(exc))
    yield SSE_DONE


async def merge_async_iterators(
    iterators: list[AsyncIterator[T]],
) -> AsyncIterator[tuple[int, T]]:
    """Items of several async iterators as they come, each with its iterator's index. Closing or
    cancelling the merge cancels the iterators still running."""
    if len(iterators) == 1:  # the common case needs no tasks
        async for item in iterators[0]:
            yield 0, item
        return
    pending: dict[asyncio.Future[T], int] = {
        asyncio.ensure_future(anext(it)): i for i, it in enumerate(iterators)
    }
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                index = pending.pop(future)
                try:
                    item = future.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(iterators[index]))] = index
                yield index, item
    finally:
        # Cancelling a task cancels the generator it runs (which aborts its request).
        for future in pending:
            future.cancel()


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read, so the next message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def run_or_abort(request: Request, work: Awaitable[T]) -> T | None:
    """Run ``work`` (a non-streaming generation) unless the client disconnects first, in which
    case ``work`` is cancelled (aborting its requests) and None is returned."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler was cancelled (e.g. a forced shutdown)
        task.cancel()
        watcher.cancel()
        raise
    watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    logger.info("client disconnected: request aborted")
    return None


__all__ = ["SSE_DONE", "merge_async_iterators", "run_or_abort", "sse", "sse_events"]
