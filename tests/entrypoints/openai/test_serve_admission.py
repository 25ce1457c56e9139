"""``--max-num-waiting`` decides admission before a response starts: a request is either
refused with a 503 status or streams to its end, never a 200 with an in-stream 503; and
requests that fit free batch slots are not counted as waiting, so an idle engine takes a burst
as large as its batch."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kiln.testing.server import BASE_ARGS, KilnServer, parse_sse, wait_until_idle

pytestmark = pytest.mark.slow

MAX_NUM_SEQS = 8
MAX_NUM_WAITING = 4


@pytest.fixture(scope="module")
def server(model_path: str) -> Iterator[KilnServer]:
    args = ["--max-num-seqs", str(MAX_NUM_SEQS), "--max-num-waiting", str(MAX_NUM_WAITING)]
    kiln = KilnServer([*BASE_ARGS, *args])
    yield kiln
    kiln.stop()


def _burst(server: KilnServer, num_requests: int, max_tokens: int) -> list[Any]:
    """Streaming requests sent together; each result is its status (non-200) or its events."""
    results: list[Any] = [None] * num_requests
    barrier = threading.Barrier(num_requests)
    body = {"prompt": "Hello", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}

    def run(i: int) -> None:
        with httpx.Client(base_url=server.url, timeout=120) as http:
            barrier.wait()
            with http.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    response.read()
                    results[i] = response.status_code
                else:
                    results[i] = parse_sse(response.iter_lines())

    threads = [threading.Thread(target=run, args=(i,)) for i in range(num_requests)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    return results


def test_an_idle_engine_takes_a_burst_as_large_as_its_batch(server: KilnServer) -> None:
    results = _burst(server, MAX_NUM_SEQS, max_tokens=4)
    assert all(isinstance(r, list) for r in results), results
    with httpx.Client(base_url=server.url) as http:
        wait_until_idle(http)


def test_a_refused_request_is_refused_before_its_response_starts(server: KilnServer) -> None:
    results = _burst(server, 3 * (MAX_NUM_SEQS + MAX_NUM_WAITING), max_tokens=24)
    refused = [r for r in results if not isinstance(r, list)]
    streamed = [r for r in results if isinstance(r, list)]
    assert set(refused) <= {503}
    assert refused and len(streamed) >= MAX_NUM_SEQS + MAX_NUM_WAITING
    for events in streamed:
        assert not [e for e in events if isinstance(e, dict) and "error" in e], events
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
