"""``kiln serve`` with kiln-x86 installed: the API server on its reserved core and the engine's
model thread alone on the other, and the reference platform still served with ``--platform cpu``
(its engine process must not auto-select x86 before it reads the flag)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

pytestmark = [pytest.mark.plugin, pytest.mark.slow]

CORES = sorted(os.sched_getaffinity(0))
ARGS = ["--dtype", "float32", "--kv-cache-memory", "0.25", "--max-model-len", "512"]


@contextlib.contextmanager
def kiln_serve(*flags: str):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = tempfile.TemporaryFile("w+")
    command = [sys.executable, "-m", "kiln.entrypoints.cli", "serve", *ARGS, *flags]
    command += ["--host", "127.0.0.1", "--port", str(port), "--uvicorn-log-level", "warning"]
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                pytest.fail(f"kiln serve did not start (rc={proc.poll()}):\n{log.read()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.5)
        yield proc.pid, url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()


def _allowed(pid: int, tid: int | None = None) -> set[int]:
    path = f"/proc/{pid}/task/{tid or pid}/status"
    with open(path) as f:
        line = next(line for line in f if line.startswith("Cpus_allowed_list"))
    cpus: set[int] = set()
    for part in line.split(":", 1)[1].strip().split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def _engine_pid(server_pid: int) -> int:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if parent == server_pid and b"spawn_main" in f.read():
                    return int(entry)
    raise LookupError(f"no engine-core child of {server_pid}")


def _complete(url: str) -> str:
    body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


@pytest.mark.skipif(len(CORES) < 2, reason="needs two usable cores")
def test_api_server_and_model_thread_each_own_a_core():
    with kiln_serve("--plugin-config", '{"x86": {"reserved_cpus": 1}}') as (pid, url):
        assert _complete(url)
        assert _allowed(pid) == {CORES[0]}
        engine = _engine_pid(pid)
        # One model thread, the engine's main thread (OpenMP thread 0), alone on the other core.
        assert _allowed(engine) == {CORES[1]}


def test_the_reference_platform_is_still_served_with_platform_cpu():
    with kiln_serve("--platform", "cpu") as (pid, url):
        assert _complete(url)
        plugins = httpx.get(f"{url}/debug/plugins", timeout=30).json()
        assert plugins["platform"]["name"] == "cpu"
