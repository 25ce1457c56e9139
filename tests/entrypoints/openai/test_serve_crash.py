"""A SIGKILLed API server: its engine core notices in any state (here: busy, with more outputs
queued than the socket holds), exits promptly and removes the socket directory it was given."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import httpx
import pytest

from kiln.testing.server import BASE_ARGS, KilnServer, engine_core_pid, ipc_dirs, is_running

pytestmark = pytest.mark.slow

# Long enough that the engine would still be generating well after the deadline below, were it
# not to notice its parent's death while busy (about 25 ms a step here).
LONG = {"prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True, "stream": True}
EXIT_DEADLINE_S = 10


def test_engine_core_exits_when_the_server_is_killed_mid_generation(model_path: str) -> None:
    server = KilnServer([*BASE_ARGS, "--max-num-seqs", "8"])
    engine = engine_core_pid(server.proc.pid)
    try:
        sockets = ipc_dirs(server.proc.pid)
        assert sockets and all(os.path.isdir(d) for d in sockets)
        http = httpx.Client(base_url=server.url, timeout=30)
        streams = []
        for _ in range(8):
            request = http.build_request("POST", "/v1/completions", json=LONG)
            response = http.send(request, stream=True)
            assert response.status_code == 200
            streams.append(response)
        for response in streams:  # every request is generating
            next(line for line in response.iter_lines() if line.startswith("data: "))
        os.kill(server.proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        while is_running(engine) and time.monotonic() - killed < EXIT_DEADLINE_S:
            time.sleep(0.1)
        assert not is_running(engine), "the engine core outlived its API server"
        assert not [d for d in sockets if os.path.exists(d)], "socket directory left behind"
        for response in streams:
            response.close()
        http.close()
    finally:
        server.stop()
        with contextlib.suppress(ProcessLookupError):
            os.kill(engine, signal.SIGKILL)
