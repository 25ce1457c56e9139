"""A tensor-parallel rank killed mid-request: the request in flight ends with an error promptly,
``/health`` answers 503 while the server winds down, ``kiln serve`` exits non-zero, and no worker
process is left behind."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import httpx
import pytest

from kiln.testing.server import BASE_ARGS, KilnServer, child_pids, engine_core_pid, is_running

pytestmark = pytest.mark.slow

LONG = {"prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True, "stream": True}
ERROR_DEADLINE_S = 10
EXIT_DEADLINE_S = 30


def _worker_pids(engine_pid: int) -> list[int]:
    """The engine core's children that run ``kiln.executor.multiproc.main`` (one per rank)."""
    pids = []
    for pid in child_pids(engine_pid):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"kiln.executor.multiproc" in f.read():
                pids.append(pid)
    return sorted(pids)


def test_killing_a_rank_mid_request_fails_it_and_stops_the_server(gguf_path):
    # Two ranks load the model side by side (and kiln-x86 may build its kernels first).
    server = KilnServer([*BASE_ARGS, "--tensor-parallel-size", "2"], start_timeout=600)
    engine = engine_core_pid(server.proc.pid)
    workers = _worker_pids(engine)
    try:
        assert len(workers) == 2
        http = httpx.Client(base_url=server.url, timeout=60)
        request = http.build_request("POST", "/v1/completions", json=LONG)
        response = http.send(request, stream=True)
        assert response.status_code == 200
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # generating
        os.kill(workers[1], signal.SIGKILL)
        killed = time.monotonic()
        rest = [line for line in lines if line.startswith("data: ")]
        assert time.monotonic() - killed < ERROR_DEADLINE_S
        assert any('"error"' in line for line in rest), rest[-3:]
        with contextlib.suppress(httpx.HTTPError):  # the server may already be gone
            assert http.get("/health", timeout=2).status_code == 503
        status = server.proc.wait(EXIT_DEADLINE_S)
        assert status != 0
        deadline = time.monotonic() + EXIT_DEADLINE_S
        while any(is_running(p) for p in [engine, *workers]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in [engine, *workers] if is_running(p)], "processes left behind"
        response.close()
        http.close()
    finally:
        server.stop()
        for pid in [engine, *workers]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
