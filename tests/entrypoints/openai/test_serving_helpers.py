"""The server's pieces that need no model: SSE error framing, merging prompt streams, errors."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from kiln.engine.async_llm import QueueFullError
from kiln.entrypoints.openai.errors import OpenAIError, bad_request, to_openai_error
from kiln.entrypoints.openai.streams import merge_async_iterators, sse, sse_events
from kiln.messages import EngineDeadError


async def _collect(iterator: AsyncIterator) -> list:
    return [item async for item in iterator]


def test_sse_events_error_mid_stream_then_done() -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield sse({"n": 1})
        raise EngineDeadError('a step failed:\nTraceback...\n  File "/srv/kiln/worker.py"')

    events = asyncio.run(_collect(sse_events(chunks())))
    assert events[0] == b'data: {"n":1}\n\n'
    error = json.loads(events[1].removeprefix(b"data: "))["error"]
    assert error["code"] == 503 and "not running" in error["message"]
    assert "Traceback" not in error["message"] and "/srv" not in error["message"]
    assert events[2] == b"data: [DONE]\n\n" and len(events) == 3


def test_sse_events_ends_with_done() -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield sse({"n": 1})

    assert asyncio.run(_collect(sse_events(chunks())))[-1] == b"data: [DONE]\n\n"


def test_merge_interleaves_and_tags_by_index() -> None:
    # Readiness is made by hand, not by sleeps (on a busy machine two timers fall due together):
    # stream 0 has nothing until stream 1's first item is out.
    async def merged() -> list:
        first_out = asyncio.Event()

        async def slow() -> AsyncIterator[str]:
            await first_out.wait()
            for i in range(2):
                yield f"a{i}"

        async def fast() -> AsyncIterator[str]:
            yield "b0"
            first_out.set()  # asked for its next item: b0 has been taken
            for i in range(1, 3):
                await asyncio.sleep(0)
                yield f"b{i}"

        return await _collect(merge_async_iterators([slow(), fast()]))

    items = asyncio.run(merged())
    assert sorted(items) == [(0, "a0"), (0, "a1"), (1, "b0"), (1, "b1"), (1, "b2")]
    assert items[0] == (1, "b0")  # the stream with an item first comes first, not stream 0
    assert [item for i, item in items if i == 0] == ["a0", "a1"]  # each stream in its order
    assert [item for i, item in items if i == 1] == ["b0", "b1", "b2"]


def test_closing_the_merge_cancels_the_streams() -> None:
    closed: list[int] = []

    async def forever(index: int) -> AsyncIterator[int]:
        try:
            while True:
                await asyncio.sleep(0.01)
                yield index
        finally:
            closed.append(index)

    async def main() -> None:
        merged = merge_async_iterators([forever(0), forever(1)])
        await anext(merged)
        await merged.aclose()
        await asyncio.sleep(0.05)

    asyncio.run(main())
    assert sorted(closed) == [0, 1]


@pytest.mark.parametrize(
    ("exc", "status"),
    [
        (ValueError("temperature must be >= 0, got -1"), 400),
        (QueueFullError("full"), 503),
        (EngineDeadError("dead"), 503),
        (RuntimeError("bug"), 500),
        (OpenAIError("nope", 404), 404),
    ],
)
def test_to_openai_error(exc: BaseException, status: int) -> None:
    error = to_openai_error(exc)
    assert error.status_code == status
    body = error.to_dict()["error"]
    assert body["code"] == status and set(body) == {"message", "type", "param", "code"}
    if status == 503 and isinstance(exc, QueueFullError):
        assert error.headers == {"Retry-After": "1"}


def test_bad_request_names_the_field() -> None:
    error = bad_request(ValueError("top_p must be in (0, 1], got 0"), {"top_p"})
    assert error.param == "top_p" and error.status_code == 400
    assert bad_request(ValueError("something else"), {"top_p"}).param is None


def test_an_unexpected_error_is_a_500_that_keeps_the_connection(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A real uvicorn on loopback: after a 500 the same keep-alive connection serves the next
    request (Starlette's last-resort handler re-raises, and uvicorn then drops the connection
    without ``Connection: close``)."""
    import http.client
    import socket
    import threading
    import time

    import uvicorn
    from fastapi import FastAPI

    from kiln.entrypoints.openai.api_server import InternalErrorMiddleware
    from kiln.entrypoints.openai.errors import install_exception_handlers

    app = FastAPI()
    install_exception_handlers(app)
    app.add_middleware(InternalErrorMiddleware)

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("a bug")

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        for _ in range(2):  # the second request reuses the connection
            connection.request("GET", "/boom")
            response = connection.getresponse()
            body = json.loads(response.read())
            assert response.status == 500
            message = body["error"]["message"]
            assert body["error"]["code"] == 500 and "error id" in message
            assert "a bug" not in message and "RuntimeError" not in message
            error_id = message.split("error id ")[1].split(")")[0]
            logged = [r for r in caplog.records if error_id in r.getMessage()]
            assert logged and "a bug" in str(logged[0].exc_info[1])
            assert response.getheader("connection") != "close"
        connection.close()
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
