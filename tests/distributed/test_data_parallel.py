"""Data parallelism (``--data-parallel-size``), the executor default and the core split.

Against one ``kiln serve --data-parallel-size 2`` of a small random Llama (module-scoped): a
request goes to the engine with the fewest unfinished requests (ties: the lowest index), an abort
reaches the engine that has the request, ``/metrics`` counts each engine apart (``engine``
label), greedy tokens equal one engine's (offline ``LLM``), each engine's KV cache is half the
budget, and the engines run on disjoint cores. Last, one engine core is killed: the requests in
flight on both engines end with an error, ``/health`` answers 503, ``kiln serve`` exits non-zero
and no process is left.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import pathlib
import re
import signal
import time
from collections.abc import Iterator

import httpx
import pytest

from kiln import LLM, SamplingParams
from kiln.config import KilnConfig, ParallelConfig
from kiln.executor import Executor
from kiln.executor.multiproc import MultiprocExecutor
from kiln.executor.uniproc import UniProcExecutor
from kiln.platforms import worker_cpus
from kiln.testing.models import save_tiny_model
from kiln.testing.server import KilnServer, child_pids, is_running, metric, scrape

KV_CACHE_GIB = 0.1
MAX_MODEL_LEN = 32768
"""Long enough that a stream of the tiny model outlasts the test's steps (~1 ms a token alone)."""
PROMPTS = [[1, 5, 9, 200, 17, 3], [3, 250, 7], [(11 * i) % 256 for i in range(1, 40)]]
GREEDY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
DEADLINE_S = 30
ABORT_DEADLINE_S = 5


def _config(**parallel) -> KilnConfig:
    return KilnConfig(parallel=ParallelConfig(**parallel))


# -- the core split (kiln.platforms.worker_cpus, documented for plugins) --------------------------


@pytest.mark.parametrize(
    ("num_cpus", "dp", "tp", "expected"),
    [
        (8, 2, 2, [[0, 1], [2, 3], [4, 5], [6, 7]]),  # engine-major: engine 0's ranks first
        (5, 2, 1, [[0, 1, 2], [3, 4]]),  # the first share one core larger
        (2, 2, 1, [[0], [1]]),
        (3, 2, 2, [[0], [1], [2], [0]]),  # fewer cores than workers: one each, wrapping
        (4, 1, 1, [[0, 1, 2, 3]]),
    ],
)
def test_worker_cpus_splits_the_cores_between_engines_and_ranks(num_cpus, dp, tp, expected):
    cpus = [10 + c for c in range(num_cpus)]  # ids that are not indexes
    shares = [
        worker_cpus(
            _config(data_parallel_size=dp, tensor_parallel_size=tp, data_parallel_rank=e, rank=r),
            cpus,
        )
        for e in range(dp)
        for r in range(tp)
    ]
    assert shares == [[10 + c for c in share] for share in expected]


def test_worker_cpus_is_in_the_plugin_api():
    guide = (pathlib.Path(__file__).parents[2] / "docs" / "plugins.md").read_text()
    section = guide[guide.index("## 6. What a plugin may import") :]
    assert "| `worker_cpus` | `worker_cpus(config, cpus)`:" in section
    assert list(inspect.signature(worker_cpus).parameters) == ["config", "cpus"]
    from kiln import plugin_api

    assert plugin_api.worker_cpus is worker_cpus


def test_x86_splits_the_model_cores_of_engines_and_ranks():
    binding = pytest.importorskip("kiln_x86.binding")
    from kiln_x86.options import X86Options

    plans = [
        binding.plan_binding(
            X86Options(reserved_cpus=1),
            "worker",
            list(range(9)),
            _config(data_parallel_size=2, tensor_parallel_size=2, data_parallel_rank=e, rank=r),
        ).model_cpus
        for e in range(2)
        for r in range(2)
    ]
    assert plans == [(0, 1, 2), (3, 4), (5, 6), (7, 8)]  # workers do not reserve a core
    engine = binding.plan_binding(
        X86Options(reserved_cpus=1), "engine", list(range(5)), _config(data_parallel_size=2)
    )
    assert engine.model_cpus == (1, 2)  # core 0 is the API server's; engine 0 gets 1-2 of 1-4


# -- executor default, KV budget, offline refusal ---------------------------------------------


def test_executor_default_is_uni_for_one_rank_and_mp_for_more():
    assert Executor.get_class(_config()) is UniProcExecutor
    assert Executor.get_class(_config(tensor_parallel_size=2)) is MultiprocExecutor
    assert Executor.get_class(_config(distributed_executor_backend="mp")) is MultiprocExecutor
    with pytest.raises(ValueError, match=r"parallel.distributed_executor_backend='uni'.*'mp'"):
        _config(tensor_parallel_size=2, distributed_executor_backend="uni")


def test_offline_llm_refuses_data_parallelism(gguf_path):
    with pytest.raises(ValueError, match=r"parallel.data_parallel_size=2 .*allowed: 1"):
        LLM(gguf_path, data_parallel_size=2)


# -- against a DP=2 server ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return save_tiny_model(
        tmp_path_factory.mktemp("tiny") / "llama",
        "llama",
        max_position_embeddings=MAX_MODEL_LEN,
        initializer_range=0.2,  # peaked logits: no greedy ties
    )


def _server_args(model: str, tokenizer: str, *flags: str) -> list[str]:
    return [
        model,
        "--tokenizer",
        tokenizer,
        "--dtype",
        "float32",
        "--kv-cache-memory",
        str(KV_CACHE_GIB),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--graph-capture-sizes",
        "",  # no decode graphs: compiling them takes minutes on a busy machine
        "--disable-log-stats",
        "--uvicorn-log-level",
        "warning",
        *flags,
    ]


@pytest.fixture(scope="module")
def dp_server(tiny_model, gguf_path):
    # Two engines load side by side (and kiln-x86 may build its kernels first). Where detection
    # puts it (kiln-x86 in CI, which gives each engine its own cores), not on the core tests'
    # cpu; the in-process engine its tokens are compared with is cpu's.
    args = _server_args(tiny_model, gguf_path, "--data-parallel-size", "2")
    server = KilnServer(args, start_timeout=600, detect_platform=True)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def http(dp_server):
    with httpx.Client(base_url=dp_server.url, timeout=120) as client:
        yield client


def _engine_pids(server: KilnServer) -> list[int]:
    """The engine cores' pids in engine order, as the banner lists them."""
    match = re.search(r"2 engine cores \(data parallel\), pids (\d+), (\d+)", server.output())
    assert match, server.output()
    return [int(match.group(1)), int(match.group(2))]


def _complete(http: httpx.Client, prompt: list[int]) -> str:
    response = http.post("/v1/completions", json={"prompt": prompt, **GREEDY})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def _finished(http: httpx.Client, engine: int, reason: str) -> float:
    return metric(
        scrape(http), "vllm:request_success_total", engine=str(engine), finished_reason=reason
    )


def _open_stream(http: httpx.Client) -> tuple[httpx.Response, Iterator[str]]:
    """A long greedy stream and its lines, once its first event has arrived (its engine is
    generating)."""
    body = {"prompt": PROMPTS[0], "max_tokens": MAX_MODEL_LEN - 64, "ignore_eos": True}
    response = http.send(
        http.build_request("POST", "/v1/completions", json={**body, "stream": True}), stream=True
    )
    assert response.status_code == 200
    lines = response.iter_lines()
    next(line for line in lines if line.startswith("data: "))
    return response, lines


def _wait_running(http: httpx.Client, engine: int, expected: int) -> float:
    """``vllm:num_requests_running`` of ``engine`` once it equals ``expected`` (or at the
    deadline: an abort must reach the engine well before a long stream could finish)."""
    deadline = time.monotonic() + ABORT_DEADLINE_S
    while True:
        running = metric(scrape(http), "vllm:num_requests_running", engine=str(engine))
        if running == expected or time.monotonic() > deadline:
            return running
        time.sleep(0.1)


@pytest.mark.slow
def test_requests_go_to_the_least_busy_engine_and_aborts_to_theirs(
    dp_server, http, tiny_model, gguf_path
):
    # Both idle: the first stream goes to engine 0 (lowest index), the second to engine 1.
    # Keep each stream's line iterator: dropping one closes its connection (an abort).
    (stream_0, lines_0), (stream_1, lines_1) = _open_stream(http), _open_stream(http)
    assert _wait_running(http, 0, 1) == 1 and _wait_running(http, 1, 1) == 1
    # Closing a stream aborts its request, on the engine that has it: engine 1 stops.
    stream_1.close()
    assert _wait_running(http, 1, 0) == 0
    assert _wait_running(http, 0, 1) == 1
    # Engine 0 has one unfinished request, engine 1 none: both of these go to engine 1 (round
    # robin would send the second to engine 0).
    on_engine_1 = [_complete(http, PROMPTS[1]), _complete(http, PROMPTS[2])]
    assert (_finished(http, 1, "length"), _finished(http, 0, "length")) == (2, 0)
    stream_0.close()
    del lines_0, lines_1
    assert _wait_running(http, 0, 0) == 0
    on_engine_0 = _complete(http, PROMPTS[2])  # both idle again: engine 0
    assert (_finished(http, 0, "length"), _finished(http, 1, "length")) == (1, 2)
    assert (_finished(http, 0, "abort"), _finished(http, 1, "abort")) == (1, 1)
    samples = scrape(http)
    for engine in ("0", "1"):
        assert metric(samples, "vllm:generation_tokens_total", engine=engine) > 0
        assert metric(samples, "vllm:e2e_request_latency_seconds_count", engine=engine) > 0

    # Greedy tokens: as one engine in the test's process (float32, same weights).
    llm = LLM(
        tiny_model,
        tokenizer=gguf_path,
        dtype="float32",
        kv_cache_memory=KV_CACHE_GIB,
        max_model_len=MAX_MODEL_LEN,
    )
    try:
        params = SamplingParams(**GREEDY)
        prompts = [{"prompt_token_ids": p} for p in (PROMPTS[1], PROMPTS[2], PROMPTS[2])]
        single = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.llm_engine.shutdown()
    assert [*on_engine_1, on_engine_0] == single
    assert len(set(single[:2])) == 2  # not a degenerate output


@pytest.mark.slow
def test_each_engine_has_half_the_kv_budget_and_its_own_cores(dp_server):
    # The tiny Llama: 2 layers, 2 KV heads of 32, float32, K and V, 16 slots a block.
    bytes_per_block = 2 * 2 * 2 * 32 * 4 * 16
    blocks = int(KV_CACHE_GIB * 2**30) // 2 // bytes_per_block
    assert f"({blocks:,} blocks of 16) per engine" in dp_server.output()
    if "platform   x86" not in dp_server.output():
        pytest.skip("core pinning is the x86 platform's")
    pids = _engine_pids(dp_server)
    cores = [os.sched_getaffinity(pid) for pid in pids]  # each engine's main (model) thread
    assert not cores[0] & cores[1], cores


@pytest.mark.slow
def test_killing_one_engine_core_fails_the_requests_and_stops_the_server(dp_server, http):
    # Runs last in the module: the server does not survive it.
    pids = _engine_pids(dp_server)
    streams = [_open_stream(http), _open_stream(http)]  # one on each engine
    assert _wait_running(http, 1, 1) == 1
    os.kill(pids[1], signal.SIGKILL)
    killed = time.monotonic()
    for response, lines in streams:
        rest = [line for line in lines if line.startswith("data: ")]
        assert any('"error"' in line for line in rest), rest[-3:]
        response.close()
    assert time.monotonic() - killed < DEADLINE_S
    with contextlib.suppress(httpx.HTTPError):  # the server may already be gone
        assert http.get("/health", timeout=2).status_code == 503
    assert dp_server.proc.wait(DEADLINE_S) != 0
    _assert_gone(pids)


def _assert_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while any(is_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if is_running(p)], "processes left behind"


# -- a worker that dies while the engine is idle --------------------------------------------------


@pytest.mark.slow
def test_a_rank_killed_while_idle_turns_health_503_and_stops_the_server(tiny_model, gguf_path):
    # TP=2 with no backend named: the mp executor (one process per rank).
    server = KilnServer(
        _server_args(tiny_model, gguf_path, "--tensor-parallel-size", "2"), start_timeout=600
    )
    engine = [p for p in child_pids(server.proc.pid) if "spawn_main" in _cmdline(p)][0]
    workers = [p for p in child_pids(engine) if "kiln.executor.multiproc" in _cmdline(p)]
    try:
        assert len(workers) == 2
        with httpx.Client(base_url=server.url, timeout=60) as http:
            assert _complete(http, PROMPTS[1])
            time.sleep(1)  # idle: the engine core waits for input
            os.kill(workers[1], signal.SIGKILL)
            deadline = time.monotonic() + DEADLINE_S
            status = 200
            while status == 200 and time.monotonic() < deadline:
                try:
                    status = http.get("/health", timeout=2).status_code
                except httpx.HTTPError:
                    status = 0  # already gone
                time.sleep(0.1)
            assert status != 200
        assert server.proc.wait(DEADLINE_S) != 0
        _assert_gone([engine, *workers])
    finally:
        server.stop()
        for pid in [engine, *workers]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _cmdline(pid: int) -> str:
    with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().decode(errors="replace")
    return ""
