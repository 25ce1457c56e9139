"""A chaos soak of a real ``kiln serve``, bounded in time: mixed requests at concurrency 8 (plain
and streamed, base model and LoRA adapters), with faults injected while they run:

- clients that disconnect mid-request (a fifth of the streams);
- one adapter folder removed while its requests run (``victim``: its later requests are 400s);
- one malformed frame written to the API server's engine-output socket;
- one stalled engine step (SIGSTOP for longer than ``--engine-stall-timeout``, then SIGCONT).

It must end with no error outside the injected ones, every request answered, the KV cache empty,
the RSS of each process sampled (printed), and every process gone after SIGTERM. It lives with
the LoRA tests for their tiny model and adapters (``conftest.py``).
"""

from __future__ import annotations

import glob
import os
import pathlib
import random
import shutil
import signal
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
import zmq

from kiln.testing.server import (
    BASE_ARGS,
    KilnServer,
    engine_core_pid,
    ipc_dirs,
    is_running,
    metric,
    wait_until_idle,
)

pytestmark = pytest.mark.slow

NUM_REQUESTS = 160
CONCURRENCY = 8
STALL_TIMEOUT_S = 1
STALL_S = 3
PROMPT = [1, 17, 42, 99, 7, 3, 250, 31]


@pytest.fixture(scope="module")
def victim(adapters, tmp_path_factory) -> pathlib.Path:
    folder = tmp_path_factory.mktemp("chaos") / "victim"
    shutil.copytree(adapters[0].path, folder)
    return folder


@pytest.fixture(scope="module")
def server(tiny_base, adapters, victim, gguf_path):
    args = [tiny_base, "--tokenizer", gguf_path, *BASE_ARGS, "--max-num-seqs", "8"]
    args += ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]
    args += ["--lora-modules", f"a1={adapters[1].path}", f"victim={victim}"]
    args += ["--engine-stall-timeout", str(STALL_TIMEOUT_S)]
    kiln = KilnServer(args)
    yield kiln
    kiln.stop()


def _request(http: httpx.Client, rng: random.Random, model: str) -> tuple[str, float]:
    """One request; returns its outcome (``ok``, ``disconnected``, ``stream error`` or ``HTTP
    <status>``) and when it ended."""
    return _outcome(http, rng, model), time.monotonic()


def _outcome(http: httpx.Client, rng: random.Random, model: str) -> str:
    body = {"model": model, "prompt": PROMPT, "max_tokens": rng.randint(4, 24), "ignore_eos": True}
    if rng.random() < 0.5:
        response = http.post("/v1/completions", json=body)
        return "ok" if response.status_code == 200 else f"HTTP {response.status_code}"
    disconnect = rng.random() < 0.2
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        if response.status_code != 200:
            response.read()
            return f"HTTP {response.status_code}"
        for line in response.iter_lines():
            if disconnect:
                return "disconnected"  # leaving the block closes the connection
            if '"error"' in line:
                return "stream error"
    return "ok"


def _malformed_frame(server: KilnServer) -> None:
    (folder,) = ipc_dirs(server.proc.pid)
    (address,) = glob.glob(f"{folder}/*-out")
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(f"ipc://{address}")
    push.send_multipart([b"outputs", b"\xc1 not msgpack"])
    push.close(linger=5000)
    ctx.term()


def test_chaos_soak(server: KilnServer, victim: pathlib.Path) -> None:
    rng = random.Random(0)
    engine = engine_core_pid(server.proc.pid)
    processes = {"api": psutil.Process(server.proc.pid), "engine": psutil.Process(engine)}
    rss: dict[str, list[float]] = {name: [] for name in processes}
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.5):
            for name, process in processes.items():
                rss[name].append(process.memory_info().rss / 2**20)

    models = ["a1", "victim", server_base_name(server)]
    jobs = [(random.Random(i), models[i % 3]) for i in range(NUM_REQUESTS)]
    outcomes: Counter[tuple[str, str]] = Counter()
    removed_at = NUM_REQUESTS // 3
    stalled_at, malformed_at = NUM_REQUESTS // 2, 2 * NUM_REQUESTS // 3
    health_during_stall = []
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    with (
        httpx.Client(base_url=server.url, timeout=60) as http,
        ThreadPoolExecutor(CONCURRENCY) as pool,
    ):
        futures = []
        removed_time = float("inf")
        for index, (job_rng, model) in enumerate(jobs):
            if index == removed_at:
                # From the first file removed: a request loading the adapter while rmtree runs
                # sees a half-removed folder and fails before rmtree returns.
                removed_time = time.monotonic()
                shutil.rmtree(victim)
            if index == malformed_at:
                _malformed_frame(server)
            futures.append((index, model, pool.submit(_request, http, job_rng, model)))
            if index == stalled_at:  # with this request waiting on it: a stall, not idleness
                os.kill(engine, signal.SIGSTOP)
                time.sleep(STALL_S)
                health_during_stall.append(http.get("/health").status_code)
                os.kill(engine, signal.SIGCONT)
            time.sleep(rng.uniform(0, 0.05))
        for _, model, future in futures:
            outcome, ended = future.result()
            injected = model == "victim" and ended > removed_time and outcome == "HTTP 400"
            outcomes[(outcome if not injected else "victim 400", model)] += 1
        samples = wait_until_idle(http, timeout=30)
        health_after = http.get("/health").status_code
    stop.set()
    sampler.join(5)
    print(f"\nchaos soak: {dict(outcomes)}")
    for name, values in rss.items():
        print(f"RSS {name} MiB: start {values[0]:.0f}, max {max(values):.0f}, end {values[-1]:.0f}")
    unexpected = {
        key: count
        for key, count in outcomes.items()
        if key[0] not in ("ok", "disconnected", "victim 400")
    }
    assert not unexpected, f"errors outside the injected ones: {unexpected}"
    assert sum(outcomes.values()) == NUM_REQUESTS
    assert outcomes[("victim 400", "victim")] > 0, "the removed adapter's requests never failed"
    assert sum(n for (o, _), n in outcomes.items() if o == "disconnected") > 0
    assert health_during_stall == [503] and health_after == 200
    assert metric(samples, "vllm:kv_cache_usage_perc") == 0
    assert metric(samples, "vllm:num_requests_running") == 0
    assert "dropped a malformed frame" in server.output()
    children = [p.pid for p in processes["api"].children(recursive=True)]
    assert server.stop() == 0
    deadline = time.monotonic() + 10
    while any(is_running(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in children if is_running(pid)], "a process outlived kiln serve"


def server_base_name(server: KilnServer) -> str:
    models = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]
    return next(card["id"] for card in models if card["parent"] is None)
