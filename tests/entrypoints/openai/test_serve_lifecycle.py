"""Lifecycle against real servers of this module's own: client disconnects abort their requests,
a full waiting queue answers 503, a stalled engine core turns /health to 503 until it is heard
from again, SIGTERM drains then aborts and leaves no process behind, and a
dead engine ends a stream with an error event, turns /health to 503 and makes the server exit
with status 1."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kiln.testing.server import (
    BASE_ARGS,
    KilnServer,
    child_pids,
    engine_core_pid,
    is_running,
    metric,
    scrape,
    wait_until_idle,
)

SHUTDOWN_TIMEOUT = 8
STALL_TIMEOUT = 3
# Two requests run at a time and one more may wait: a third waiting request is refused.
ARGS = [*BASE_ARGS, "--max-num-seqs", "2", "--max-num-waiting", "1"]
LONG = {"prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True, "stream": True}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(model_path: str) -> Iterator[KilnServer]:
    kiln = KilnServer(
        [
            *ARGS,
            "--shutdown-timeout",
            str(SHUTDOWN_TIMEOUT),
            "--engine-stall-timeout",
            str(STALL_TIMEOUT),
        ]
    )
    yield kiln
    kiln.stop()


@pytest.fixture(scope="module")
def http(server: KilnServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def _open_stream(http: httpx.Client, body: dict[str, Any]) -> tuple[Any, Iterator[str]]:
    """Start a streaming request; returns the response (close it to disconnect) and its lines."""
    request = http.build_request("POST", "/v1/completions", json=body)
    response = http.send(request, stream=True)
    assert response.status_code == 200, response.read()
    return response, response.iter_lines()


def _next_event(lines: Iterator[str]) -> Any:
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            return payload if payload == "[DONE]" else json.loads(payload)
    raise AssertionError("the stream ended without [DONE]")


def _wait_for(http: httpx.Client, name: str, value: float, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while metric(scrape(http), name) != value:
        assert time.monotonic() < deadline, f"{name} never reached {value}"
        time.sleep(0.1)


def test_stream_disconnect_frees_the_engine(http: httpx.Client) -> None:
    response, lines = _open_stream(http, LONG)
    for _ in range(3):
        _next_event(lines)
    assert metric(scrape(http), "vllm:num_requests_running") == 1
    response.close()
    samples = wait_until_idle(http)
    assert metric(samples, "vllm:num_requests_running") == 0
    assert metric(samples, "vllm:kv_cache_usage_perc") == 0
    # The engine is free: a short request is served at once.
    body = {"prompt": "Hi", "max_tokens": 2}
    assert http.post("/v1/completions", json=body, timeout=10).status_code == 200


def test_non_stream_disconnect_frees_the_engine(http: httpx.Client) -> None:
    body = {**LONG, "stream": False}
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json=body, timeout=2)
    samples = wait_until_idle(http)
    assert metric(samples, "vllm:num_requests_running") == 0
    assert metric(samples, "vllm:num_requests_waiting") == 0


def test_full_queue_answers_503(http: httpx.Client) -> None:
    streams = []
    try:
        for _ in range(2):
            streams.append(_open_stream(http, LONG))
            _next_event(streams[-1][1])
        _wait_for(http, "vllm:num_requests_running", 2)
        streams.append(_open_stream(http, LONG))  # waits: no room in the batch
        _wait_for(http, "vllm:num_requests_waiting", 1)
        refused = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "ServiceUnavailableError"
    finally:
        for response, _ in streams:
            response.close()
    wait_until_idle(http)
    assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200


def _wait_for_health(http: httpx.Client, status: int, timeout: float) -> float:
    """Poll /health until it answers ``status``; returns the seconds that took."""
    start = time.monotonic()
    while (got := http.get("/health").status_code) != status:
        assert time.monotonic() - start < timeout, f"/health still {got}, not {status}"
        time.sleep(0.2)
    return time.monotonic() - start


def test_stalled_engine_turns_health_503_until_it_resumes(
    server: KilnServer, http: httpx.Client
) -> None:
    engine = engine_core_pid(server.proc.pid)
    os.kill(engine, signal.SIGSTOP)  # idle: nothing waits on it, so it is not stalled
    try:
        time.sleep(STALL_TIMEOUT + 2)
        assert http.get("/health").status_code == 200
    finally:
        os.kill(engine, signal.SIGCONT)
    response, lines = _open_stream(http, LONG)
    try:
        _next_event(lines)
        os.kill(engine, signal.SIGSTOP)
        try:
            waited = _wait_for_health(http, 503, STALL_TIMEOUT + 20)
            assert waited > STALL_TIMEOUT - 1.5  # not at once: a busy step is not a stall
        finally:
            os.kill(engine, signal.SIGCONT)
        _wait_for_health(http, 200, 20)
        assert isinstance(_next_event(lines), dict)  # the stream goes on
    finally:
        response.close()
    wait_until_idle(http)
    assert "stalled" in server.output() and "heard from again" in server.output()


def test_sigterm_finishes_short_requests_aborts_long_ones(server: KilnServer) -> None:
    http = httpx.Client(base_url=server.url, timeout=60)
    children = child_pids(server.proc.pid)
    assert children, "the engine core runs in a child process"
    response, lines = _open_stream(http, LONG)
    _next_event(lines)
    short: dict[str, Any] = {}

    def run_short() -> None:
        body = {"prompt": "Hello", "max_tokens": 16, "ignore_eos": True}
        short["response"] = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)

    thread = threading.Thread(target=run_short)
    thread.start()
    _wait_for(http, "vllm:num_requests_running", 2)
    signaled = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(1)
    with pytest.raises(httpx.ConnectError):  # no new connections while draining
        httpx.get(f"{server.url}/health")
    # The short request finishes normally while the server drains.
    thread.join(60)
    assert short["response"].status_code == 200
    assert short["response"].json()["choices"][0]["finish_reason"] == "length"
    # The long one is aborted once the shutdown timeout has passed.
    events = []
    while (event := _next_event(lines)) != "[DONE]":
        events.append(event)
    elapsed = time.monotonic() - signaled
    assert events[-1]["choices"][0]["finish_reason"] == "abort"
    assert SHUTDOWN_TIMEOUT - 1 < elapsed < SHUTDOWN_TIMEOUT + 10
    response.close()
    http.close()
    assert server.proc.wait(20) == 0
    deadline = time.monotonic() + 10
    while any(is_running(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in children if is_running(pid)], "a child process outlived kiln serve"


def test_dead_engine(model_path: str) -> None:
    """The request in flight gets an error event, then the server exits on its own with status 1
    (so a supervisor restarts it), leaving no process behind."""
    kiln = KilnServer(BASE_ARGS)
    try:
        with httpx.Client(base_url=kiln.url, timeout=60) as http:
            response, lines = _open_stream(http, LONG)
            _next_event(lines)
            engine = engine_core_pid(kiln.proc.pid)
            os.kill(engine, signal.SIGKILL)
            events = []
            while (event := _next_event(lines)) != "[DONE]":
                events.append(event)
            response.close()
            assert "error" in events[-1] and events[-1]["error"]["code"] == 503
            with contextlib.suppress(httpx.TransportError):  # or already closed
                assert http.get("/health").status_code == 503
        assert kiln.proc.wait(30) == 1
    finally:
        kiln.stop()
