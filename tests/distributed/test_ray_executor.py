"""The Ray executor on a local cluster of two Ray nodes (one CPU each, both on this machine):
TP=2 places one rank on each node, and greedy tokens in float32 at TP=2 and PP=2 on Ray (two
batches in flight) equal TP=1 on a small random Llama (4 KV heads, odd vocabulary) and, at TP=2,
on the default model. A rank's actor killed mid-request: the request ends with an error promptly,
``/health`` answers 503, ``kiln serve`` exits non-zero and no actor is left; killed while the
engine is idle: ``/health`` turns 503 with no request in flight, and the same. Two engines
(``--data-parallel-size 2``) on Ray run on a node each. Without a cluster address Kiln starts a
local Ray instance (here for PP=2 x TP=2, whose tokens equal TP=1) and stops it at shutdown."""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import openai
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from parallel_utils import GREEDY, TEXT_PROMPTS, TOKEN_PROMPTS, small_llm  # noqa: E402

from kiln.testing.server import API_KEY, BASE_ARGS, KilnServer, child_pids, free_port, is_running

ray = pytest.importorskip("ray")  # the optional extra: pip install 'kiln[ray]'

pytestmark = pytest.mark.slow

NODE_START_TIMEOUT_S = 120
ACTOR_TITLE = b"ray::RayWorker"
"""What Ray shows as the command line of a process that runs a Kiln rank's actor."""


def _wait_port(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return
        time.sleep(0.5)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


def _pids_with(needle: bytes) -> list[int]:
    """Processes whose command line contains ``needle``."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/cmdline", "rb") as f:
                if needle in f.read() and is_running(int(entry)):
                    pids.append(int(entry))
    return pids


@pytest.fixture(scope="module", autouse=True)
def no_ray_auth():
    """Ray without token authentication in this module, for the clusters and every driver.

    Ray 2.60 turns token authentication on for a local instance (``ray.init()`` with no
    cluster), writing ``~/.ray/auth_token``; a ``ray start`` run while that file exists turns
    it on too, but a driver connecting to the cluster does not read the file unless
    ``RAY_AUTH_MODE=token``, and fails. One mode set for all keeps the tests independent of
    what ran before on the machine (and writes no token file).
    """
    previous = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    yield
    if previous is None:
        del os.environ["RAY_AUTH_MODE"]
    else:
        os.environ["RAY_AUTH_MODE"] = previous


@pytest.fixture(scope="module")
def ray_cluster(no_ray_auth):
    """``host:port`` of a two-node Ray cluster on this machine (1 CPU per node, no dashboard,
    small object stores), in its own temp dir; every process it started is gone afterwards."""
    ray_bin = str(pathlib.Path(sys.executable).parent / "ray")
    temp_dir = tempfile.mkdtemp(prefix="kray", dir="/tmp")  # short: Ray's socket paths
    port = free_port()
    address = f"127.0.0.1:{port}"
    common = ["--num-cpus", "1", "--object-store-memory", str(80 * 1024 * 1024), "--block"]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    nodes = []
    try:
        nodes.append(
            subprocess.Popen(
                [ray_bin, "start", "--head", "--port", str(port), "--node-ip-address",
                 "127.0.0.1", "--include-dashboard=false", "--temp-dir", temp_dir, *common],
                env=env, start_new_session=True, stdout=subprocess.DEVNULL,
            )
        )  # fmt: skip
        _wait_port(port, NODE_START_TIMEOUT_S)
        nodes.append(
            subprocess.Popen(
                [ray_bin, "start", "--address", address, "--node-ip-address", "127.0.0.1",
                 *common],
                env=env, start_new_session=True, stdout=subprocess.DEVNULL,
            )
        )  # fmt: skip
        yield address
    finally:
        # Each `ray start` leads a process group (its GCS, raylet, agents); the actors' processes
        # exit with their raylet.
        for node in nodes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.pid, signal.SIGKILL)
            node.wait(30)
        for pid in _pids_with(temp_dir.encode()):  # anything that left its process group
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _on_ray(address: str, model: str, prompts: list, **kwargs) -> tuple[list, list[str], set, int]:
    """Greedy tokens on the Ray executor, the node of each rank, the cluster's live nodes, and the
    most batches that were in flight at once."""
    llm = small_llm(model, distributed_executor_backend="ray", ray_address=address, **kwargs)
    try:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        core = llm.llm_engine.engine_core
        alive = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
        tokens = [o.outputs[0].token_ids for o in outputs]
        return tokens, core.executor.node_ids, alive, core.max_num_batches_in_flight
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_tp2_on_two_ray_nodes_equals_tp1_on_a_small_random_llama(
    ray_cluster, tiny_llama, gguf_path
):
    folder, tp1 = tiny_llama
    tokens, node_ids, alive, _ = _on_ray(
        ray_cluster, folder, TOKEN_PROMPTS, tokenizer=gguf_path, tensor_parallel_size=2
    )
    assert tokens == tp1
    assert len(set(node_ids)) == 2 and set(node_ids) <= alive  # one rank on each node


def test_pp2_on_two_ray_nodes_equals_tp1_on_a_small_random_llama(
    ray_cluster, tiny_llama, gguf_path
):
    folder, tp1 = tiny_llama
    tokens, node_ids, _, in_flight = _on_ray(
        ray_cluster, folder, TOKEN_PROMPTS, tokenizer=gguf_path, pipeline_parallel_size=2
    )
    assert tokens == tp1
    assert len(set(node_ids)) == 2
    assert in_flight == 2  # three prompts: micro-batches of two and one, both in the pipeline


def test_tp2_on_two_ray_nodes_equals_tp1_on_the_default_model(
    ray_cluster, gguf_path, default_model_tokens
):
    tokens, node_ids, _, _ = _on_ray(ray_cluster, gguf_path, TEXT_PROMPTS, tensor_parallel_size=2)
    assert tokens == default_model_tokens
    assert len(set(node_ids)) == 2


def _tp2_ray_server(address: str, folder: str, tokenizer: str) -> tuple[KilnServer, list[int]]:
    """``kiln serve`` of ``folder`` at TP=2 on the Ray cluster at ``address``, and the pids of
    its two ranks' actors."""
    before = set(_pids_with(ACTOR_TITLE))
    args = [
        folder,
        *BASE_ARGS,
        "--tokenizer",
        tokenizer,
        "--kv-cache-memory",  # the last one counts: the tiny model needs little
        "0.02",
        "--tensor-parallel-size",
        "2",
        "--distributed-executor-backend",
        "ray",
        "--ray-address",
        address,
    ]
    server = KilnServer(args, start_timeout=600)
    actors = sorted(set(_pids_with(ACTOR_TITLE)) - before)
    if len(actors) != 2:
        server.stop()
        raise AssertionError(f"{len(actors)} new actor processes, not 2")
    return server, actors


def _assert_gone(server: KilnServer, actors: list[int]) -> None:
    """``kiln serve`` exits non-zero and the actors' processes end."""
    assert server.proc.wait(30) != 0
    deadline = time.monotonic() + 30
    while any(is_running(p) for p in actors) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in actors if is_running(p)], "actors left behind"


def test_without_an_address_a_local_cluster_is_started_and_stopped(
    tiny_llama, gguf_path, monkeypatch
):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    folder, tp1 = tiny_llama
    assert not ray.is_initialized()
    # PP=2 x TP=2: four actors, one CPU each, on the local instance.
    llm = small_llm(
        folder,
        tokenizer=gguf_path,
        pipeline_parallel_size=2,
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
    )
    try:
        # Its head (GCS) and node manager are this process's children.
        ray_pids = [p for p in child_pids(os.getpid()) if b"raylet" in _cmdline(p)]
        assert ray_pids and llm.llm_engine.engine_core.executor.owns_connection
        outputs = llm.generate(TOKEN_PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == tp1
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert not ray.is_initialized()
    deadline = time.monotonic() + 30
    while any(is_running(p) for p in ray_pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in ray_pids if is_running(p)], "the local cluster outlived shutdown"


def _cmdline(pid: int) -> bytes:
    with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read()
    return b""


def test_two_engines_on_ray_run_on_a_node_each(ray_cluster, tiny_llama, gguf_path):
    folder, _ = tiny_llama
    before = set(_pids_with(ACTOR_TITLE))
    args = [folder, *BASE_ARGS, "--tokenizer", gguf_path, "--kv-cache-memory", "0.02"]
    args += ["--data-parallel-size", "2", "--distributed-executor-backend", "ray"]
    server = KilnServer([*args, "--ray-address", ray_cluster], start_timeout=600)
    try:
        actors = sorted(set(_pids_with(ACTOR_TITLE)) - before)
        assert len(actors) == 2
        # A node's actors are its raylet's children: one actor under each node's raylet.
        raylets = {_parent_pid(pid) for pid in actors}
        assert len(raylets) == 2, raylets
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
        model = client.models.list().data[0].id
        for prompt in ([1, 5, 9], [3, 256, 7]):
            completion = client.completions.create(model=model, prompt=prompt, max_tokens=4)
            assert completion.choices[0].finish_reason == "length"
    finally:
        server.stop()


def _parent_pid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_killing_a_rank_actor_mid_request_fails_it_and_stops_the_server(
    ray_cluster, tiny_llama, gguf_path
):
    folder, _ = tiny_llama
    server, actors = _tp2_ray_server(ray_cluster, folder, gguf_path)
    try:
        http = httpx.Client(base_url=server.url, timeout=60)
        body = {"prompt": [1, 5, 9], "max_tokens": 200, "ignore_eos": True, "stream": True}
        response = http.send(http.build_request("POST", "/v1/completions", json=body), stream=True)
        assert response.status_code == 200
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # generating
        os.kill(actors[1], signal.SIGKILL)
        killed = time.monotonic()
        rest = [line for line in lines if line.startswith("data: ")]
        assert time.monotonic() - killed < 10
        assert any('"error"' in line for line in rest), rest[-3:]
        with contextlib.suppress(httpx.HTTPError):  # the server may already be gone
            assert http.get("/health", timeout=2).status_code == 503
        _assert_gone(server, actors)
        response.close()
        http.close()
    finally:
        server.stop()


def test_killing_a_rank_actor_while_idle_turns_health_503_and_stops_the_server(
    ray_cluster, tiny_llama, gguf_path
):
    folder, _ = tiny_llama
    server, actors = _tp2_ray_server(ray_cluster, folder, gguf_path)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
        model = client.models.list().data[0].id
        completion = client.completions.create(model=model, prompt=[1, 5, 9], max_tokens=4)
        assert completion.choices[0].finish_reason == "length"
        time.sleep(1)  # idle: the engine core waits for input
        os.kill(actors[1], signal.SIGKILL)
        killed = time.monotonic()
        status = 200
        while status == 200 and time.monotonic() - killed < 30:
            try:
                status = httpx.get(f"{server.url}/health", timeout=2).status_code
            except httpx.HTTPError:
                status = 0  # already gone
            time.sleep(0.1)
        assert status != 200, "the idle engine did not notice its dead actor"
        assert time.monotonic() - killed < 10
        _assert_gone(server, actors)
    finally:
        server.stop()
