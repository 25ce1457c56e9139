"""Helpers for tests of ``kiln serve``: ``KilnServer`` (a real ``kiln serve`` in a subprocess on a
free loopback port, in its own session so that stopping it kills everything it started), small
server defaults (``BASE_ARGS``), SSE parsing, /metrics parsing and /proc process checks. Kiln's
server, distributed, LoRA and speculation tests share them; a plugin's tests can too."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterable
from typing import Any

import httpx

from kiln.testing import forkserver

API_KEY = "test-key"
MAX_MODEL_LEN = 1024

# Small: a 0.5 GiB KV cache and a 1024-token context keep start-up and memory low.
BASE_ARGS = [
    # float32: streamed and whole answers are compared token for token, across batch shapes.
    "--dtype",
    "float32",
    "--kv-cache-memory",
    "0.5",
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--disable-log-stats",
    "--uvicorn-log-level",
    "warning",
]


def free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc)."""
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            # The command may contain spaces and parentheses: fields restart after the last ')'.
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                children.append(int(entry))
    return children


def engine_core_pid(server_pid: int) -> int:
    """The engine-core process of a ``kiln serve`` (a multiprocessing ``spawn`` child)."""
    for pid in child_pids(server_pid):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                return pid
    raise LookupError(f"no engine-core child of {server_pid}")


def is_running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def ipc_dirs(pid: int) -> set[str]:
    """Directories of the unix sockets ``pid`` has bound (from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    dirs = set()
    with open("/proc/net/unix") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if len(fields) >= 8 and fields[6] in inodes and "/kiln-" in fields[7]:
                dirs.add(os.path.dirname(fields[7]))
    return dirs


class KilnServer:
    """``kiln serve`` with ``args``; ``url`` once ``/health`` answers 200.

    It runs on the core tests' platform (``KILN_PLATFORM``, set by tests/conftest.py), or, with
    ``detect_platform``, on the one detection selects (kiln-x86 where it is installed), for a
    test whose point is that platform's behaviour behind a server.
    """

    def __init__(
        self, args: list[str], start_timeout: float = 300, detect_platform: bool = False
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kiln-serve-", suffix=".log")
        command = ["-m", "kiln.entrypoints.cli", "serve", *args]
        command += ["--host", "127.0.0.1", "--port", str(self.port)]
        env = dict(os.environ)
        if detect_platform:
            env.pop("KILN_PLATFORM", None)
        # Forked from a process that imported torch where nothing it reads differs (see
        # kiln.testing.forkserver); in its own session either way.
        self.proc = forkserver.popen(command, env, self.log, self.log, new_session=True)
        try:
            self._wait_healthy(start_timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                status = self.proc.returncode
                raise RuntimeError(f"kiln serve exited with {status}:\n{self.output()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.5)
        raise TimeoutError(f"kiln serve not healthy after {timeout} s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def stop(self, timeout: float = 30) -> int | None:
        """SIGTERM, then SIGKILL to the process group; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self.log.close()
        return self.proc.returncode


def parse_sse(lines: Iterable[str]) -> list[Any]:
    """The events of an SSE body: parsed JSON objects, and the string "[DONE]".

    Asserts the framing: every event is one ``data: `` line followed by a blank line.
    """
    events: list[Any] = []
    pending: str | None = None
    for line in lines:
        if pending is None:
            assert line.startswith("data: "), f"not an SSE data line: {line!r}"
            payload = line[len("data: ") :]
            events.append("[DONE]" if payload == "[DONE]" else json.loads(payload))
            pending = line
        else:
            assert line == "", f"an event must end with a blank line, got {line!r}"
            pending = None
    assert pending is None, "the body must end with a blank line"
    return events


def stream_events(http: httpx.Client, path: str, body: dict[str, Any]) -> list[Any]:
    """POST a streaming request and return its events (see ``parse_sse``)."""
    with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return parse_sse(response.iter_lines())


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


def scrape(http: httpx.Client) -> dict[str, float]:
    """``/metrics`` as ``{"name{labels}": value}`` (labels as exposed, in their order)."""
    response = http.get("/metrics")
    assert response.status_code == 200
    samples = {}
    for line in response.text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            samples[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return samples


def metric(samples: dict[str, float], name: str, **labels: str) -> float:
    """The value of ``name`` whose labels include ``labels``."""
    for key, value in samples.items():
        metric_name, _, label_text = key.partition("{")
        if metric_name == name and all(f'{k}="{v}"' in label_text for k, v in labels.items()):
            return value
    raise KeyError(f"{name} {labels} not in /metrics")


def wait_until_idle(http: httpx.Client, timeout: float = 15) -> dict[str, float]:
    """Poll /metrics until no request runs or waits and the KV cache is empty."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(http)
        busy = [
            metric(samples, name)
            for name in (
                "vllm:num_requests_running",
                "vllm:num_requests_waiting",
                "vllm:kv_cache_usage_perc",
            )
        ]
        if not any(busy) or time.monotonic() > deadline:
            return samples
        time.sleep(0.1)
