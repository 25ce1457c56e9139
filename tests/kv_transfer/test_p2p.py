"""Disaggregated prefill end to end: two ``kiln serve`` instances with the ``P2pConnector`` (a
producer, a consumer) behind ``kiln proxy``, the official openai client against the proxy, and
a third instance (a consumer with ``kv_load_failure_policy`` "fail") that also gives the
reference answers, computed without any transfer.

Faults are caused, not mocked: a producer that is gone (its port closed), and a man in the
middle (``Relay``) between the consumer and the real producer that corrupts, cuts or stalls the
real transfer. Each time: the same tokens (recompute) or a clear error (fail), no hang, and
the KV-usage gauges back to 0.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from kiln.kv_transfer.p2p_wire import TransferError, fetch_blocks
from kiln.testing.server import KilnServer, free_port, metric, scrape, wait_until_idle

pytestmark = pytest.mark.slow


def prompt_of(topic: str) -> str:
    """About 180 tokens (ending mid-block) that share no block with another topic's: each test
    has its own, so no instance finds it in its local prefix cache first."""
    return f"The {topic} notebook: " + " ".join(
        f"day {i}, the kiln reached {900 + 7 * i} degrees and glaze {i} turned blue;"
        for i in range(9)
    )


TOPICS = ("potter's", "gone", "corrupt", "truncate", "stall", "streamed", "unsigned")
PROMPT = prompt_of("potter's")
MESSAGES = [{"role": "user", "content": "Describe a kiln. " + PROMPT}]
SECRET = b"the instances' shared secret"


def serve(kv_role: str, extra: dict, policy: str = "recompute") -> KilnServer:
    config = {
        "kv_connector": "P2pConnector",
        "kv_role": kv_role,
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": extra,
    }
    args = ["--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "0.05"]
    return KilnServer([*args, "--kv-transfer-config", json.dumps(config)])


class Proxy:
    """``kiln proxy`` in a subprocess; ``url`` once it listens."""

    def __init__(self, prefill: list[str], decode: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "kiln.entrypoints.cli", "proxy", "--prefill", *prefill]
        command += ["--decode", *decode, "--port", str(self.port), "--connect-timeout", "2"]
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port)):
                return
            assert self.proc.poll() is None, self.proc.stderr.read().decode()  # type: ignore[union-attr]
            time.sleep(0.2)
        raise TimeoutError("kiln proxy did not listen")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


class Relay:
    """A man in the middle of one pull at a time: forwards the consumer's ask to the producer's
    block server and its answer back, after ``mode`` did its damage ("corrupt": one payload
    byte flipped; "truncate": the answer cut in half; "stall": held ``stall_s`` seconds)."""

    def __init__(self, target_port: int, mode: str, stall_s: float = 4.0) -> None:
        self.target_port, self.mode, self.stall_s = target_port, mode, stall_s
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = self.listener.accept()
                threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        with client, socket.create_connection(("127.0.0.1", self.target_port)) as upstream:
            ask = client.recv(1 << 20)
            upstream.sendall(ask)
            answer = bytearray()
            while chunk := upstream.recv(1 << 20):
                answer += chunk
            if self.mode == "corrupt":
                answer[len(answer) // 2] ^= 0xFF
            elif self.mode == "truncate":
                answer = answer[: len(answer) // 2]
            elif self.mode == "stall":
                time.sleep(self.stall_s)
            with contextlib.suppress(OSError):
                client.sendall(answer)

    def close(self) -> None:
        self.listener.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[dict]:
    kv_port = free_port()
    # Every instance signs its pulls with one shared secret (so every test here runs with it).
    secret = tmp_path_factory.mktemp("p2p") / "secret"
    secret.write_bytes(SECRET)
    signed = {"secret_file": str(secret)}
    servers: dict = {}
    try:
        servers["prefill"] = serve(
            "kv_producer", {"kv_port": kv_port, "kv_send_timeout": 4, **signed}
        )
        servers["decode"] = serve("kv_consumer", {"kv_load_timeout": 3, **signed})
        servers["strict"] = serve("kv_consumer", {"kv_load_timeout": 3, **signed}, policy="fail")
        servers["proxy"] = Proxy([servers["prefill"].url], [servers["decode"].url])
        servers["kv_port"] = kv_port
        yield servers
    finally:
        for server in servers.values():
            if hasattr(server, "stop"):
                server.stop()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


def complete(url: str, prompt: str = PROMPT, **params) -> openai.types.Completion:
    return client(url).completions.create(
        model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=10, temperature=0, **params
    )


def counter(server: KilnServer, name: str) -> float:
    with httpx.Client(base_url=server.url) as http:
        return metric(scrape(http), f"vllm:kv_connector_{name}_total")


def assert_idle(server: KilnServer, timeout: float = 15) -> None:
    """The server's KV cache gauge (and its queues) come back to 0 within ``timeout``."""
    with httpx.Client(base_url=server.url) as http:
        samples = wait_until_idle(http, timeout)
    assert metric(samples, "vllm:kv_cache_usage_perc") == 0
    assert metric(samples, "vllm:num_requests_waiting") == 0


def remote_params(cluster: dict, prompt: str = PROMPT) -> dict:
    """What the producer answers a prefill of ``prompt`` (its blocks now held for a pull)."""
    answer = httpx.post(
        f"{cluster['prefill'].url}/v1/completions",
        json={"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
        timeout=60,
    ).json()
    return answer["kv_transfer_params"]


@pytest.fixture(scope="module")
def reference(cluster) -> dict:
    """Greedy answers computed on one instance (the producer, asked plainly) without any
    transfer, by prompt (and "chat")."""
    url = cluster["prefill"].url
    chat = client(url).chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=MESSAGES, max_tokens=10, temperature=0
    )
    answers = {p: complete(url, p).choices[0].text for p in map(prompt_of, TOPICS)}
    return {**answers, "chat": chat.choices[0].message.content}


def test_1p1d_through_the_proxy_gives_the_tokens_of_one_instance(cluster, reference):
    decode = cluster["decode"]
    before = counter(decode, "loaded_blocks")
    proxy = cluster["proxy"].url
    answer = complete(proxy)
    assert answer.choices[0].text == reference[PROMPT]
    num_prompt = answer.usage.prompt_tokens
    assert num_prompt % 16, "the prompt should end mid-block"
    assert counter(decode, "loaded_blocks") - before == (num_prompt - 1) // 16
    streamed = "".join(chunk.choices[0].text for chunk in complete(proxy, stream=True))
    assert streamed == reference[PROMPT]
    chat = client(proxy).chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=MESSAGES, max_tokens=10, temperature=0
    )
    assert chat.choices[0].message.content == reference["chat"]
    assert counter(cluster["prefill"], "saved_blocks") >= counter(decode, "loaded_blocks")
    assert_idle(cluster["prefill"])
    assert_idle(decode)


def test_a_streamed_prefill_carries_kv_transfer_params_on_its_last_chunk(cluster, reference):
    prefill, decode = client(cluster["prefill"].url), cluster["decode"]
    remote = {"kv_transfer_params": {"do_remote_decode": True}}
    prompt = prompt_of("streamed")
    chunks = list(
        prefill.completions.create(
            model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=1, stream=True,
            extra_body=remote,
        )
    )  # fmt: skip
    carried = [c.model_extra.get("kv_transfer_params") for c in chunks]
    assert chunks[-1].choices[0].finish_reason is not None
    assert all(p is None for p in carried[:-1]) and carried[-1], carried
    before = counter(decode, "loaded_blocks")
    answer = complete(decode.url, prompt, extra_body={"kv_transfer_params": carried[-1]})
    assert answer.choices[0].text == reference[prompt]
    assert counter(decode, "loaded_blocks") > before

    messages = [{"role": "user", "content": "Summarize. " + prompt_of("streamed chat")}]
    plain = prefill.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, max_tokens=10, temperature=0
    )
    chat_chunks = list(
        prefill.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=messages, max_tokens=1, stream=True,
            extra_body=remote,
        )
    )  # fmt: skip
    params = [c.model_extra.get("kv_transfer_params") for c in chat_chunks if c.choices]
    assert all(p is None for p in params[:-1]) and params[-1], params
    before = counter(decode, "loaded_blocks")
    chat = client(decode.url).chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, max_tokens=10, temperature=0,
        extra_body={"kv_transfer_params": params[-1]},
    )  # fmt: skip
    assert chat.choices[0].message.content == plain.choices[0].message.content
    assert counter(decode, "loaded_blocks") > before
    assert_idle(cluster["prefill"])
    assert_idle(decode)


def test_a_pull_without_the_secret_gets_no_kv_and_leaves_the_offer(cluster, reference):
    prompt = prompt_of("unsigned")
    params = remote_params(cluster, prompt)
    layout = {"layer_block_bytes": [], "dtypes": []}  # refused before any layout is compared
    for secret in (None, b"a guess"):
        with pytest.raises(TransferError, match="not signed with the secret"):
            fetch_blocks(
                params["remote_host"], params["remote_port"], params["remote_request_id"],
                params["remote_block_ids"], layout, 5.0, secret,
            )  # fmt: skip
    decode = cluster["decode"]
    before = counter(decode, "loaded_blocks")
    answer = complete(decode.url, prompt, extra_body={"kv_transfer_params": params})
    assert answer.choices[0].text == reference[prompt]
    assert counter(decode, "loaded_blocks") > before  # the real consumer still pulled them


def test_a_producer_gone_before_the_pull_is_recomputed_or_an_error(cluster, reference):
    prompt = prompt_of("gone")
    params = remote_params(cluster, prompt)
    params["remote_port"] = free_port()  # nobody listens there any more
    decode, strict = cluster["decode"], cluster["strict"]
    failed = counter(decode, "failed_loads")
    answer = complete(decode.url, prompt, extra_body={"kv_transfer_params": params})
    assert answer.choices[0].text == reference[prompt]
    assert counter(decode, "failed_loads") == failed + 1
    with pytest.raises(openai.InternalServerError) as error:  # policy "fail"
        complete(strict.url, prompt, extra_body={"kv_transfer_params": params})
    assert error.value.status_code == 503 and "failed to load" in str(error.value)
    assert_idle(decode)
    assert_idle(strict)
    assert_idle(cluster["prefill"])  # the unpulled blocks are dropped after kv_send_timeout


@pytest.mark.parametrize("mode", ["corrupt", "truncate"])
def test_a_damaged_transfer_is_a_load_error_never_wrong_tokens(cluster, reference, mode):
    relay = Relay(cluster["kv_port"], mode)
    decode = cluster["decode"]
    failed = counter(decode, "failed_loads")
    try:
        prompt = prompt_of(mode)
        params = {**remote_params(cluster, prompt), "remote_port": relay.port}
        answer = complete(decode.url, prompt, extra_body={"kv_transfer_params": params})
    finally:
        relay.close()
    assert answer.choices[0].text == reference[prompt]
    assert counter(decode, "failed_loads") == failed + 1
    assert_idle(decode)
    assert_idle(cluster["prefill"])


def test_a_request_aborted_while_it_loads_frees_its_blocks(cluster, reference):
    # The relay holds the pull 2.5 s (under the consumer's kv_load_timeout of 3 s); the client
    # gives up after 0.5 s, and the blocks must be free long before the pull arrives.
    relay = Relay(cluster["kv_port"], "stall", stall_s=2.5)
    decode = cluster["decode"]
    try:
        prompt = prompt_of("stall")
        params = {**remote_params(cluster, prompt), "remote_port": relay.port}
        body = {"prompt": prompt, "max_tokens": 10, "kv_transfer_params": params}
        with pytest.raises(httpx.ReadTimeout):  # the client goes away: the request is aborted
            httpx.post(f"{decode.url}/v1/completions", json=body, timeout=0.5)
        assert_idle(decode, timeout=1.0)
        time.sleep(2.5)  # the stalled pull arrives for a request that is gone: dropped
    finally:
        relay.close()
    assert_idle(decode)
    assert complete(decode.url, prompt).choices[0].text == reference[prompt]


def test_bad_kv_transfer_params_are_a_400(cluster):
    url = f"{cluster['decode'].url}/v1/completions"
    for bad in ([1], {"remote_port": "x"}, {"remote_block_ids": [-1]}, {"do_remote_decode": 1}):
        answer = httpx.post(url, json={"prompt": "hi", "kv_transfer_params": bad}, timeout=10)
        assert answer.status_code == 400, bad
        assert answer.json()["error"]["param"] == "kv_transfer_params"


def test_an_error_of_the_prefill_instance_comes_back_through_the_proxy(cluster):
    with pytest.raises(openai.BadRequestError) as error:
        client(cluster["proxy"].url).completions.create(
            model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=4, temperature=-1
        )
    assert error.value.status_code == 400 and "temperature" in str(error.value)


def test_a_dead_instance_behind_the_proxy_is_a_502_not_a_hang(cluster):
    dead = f"http://127.0.0.1:{free_port()}"
    proxy = Proxy([cluster["prefill"].url], [dead])
    try:
        start = time.monotonic()
        with pytest.raises(openai.InternalServerError) as error:
            complete(proxy.url)
        assert error.value.status_code == 502 and dead in str(error.value)
        assert time.monotonic() - start < 10
        assert httpx.get(f"{proxy.url}/health", timeout=10).status_code == 503
    finally:
        proxy.stop()
    assert_idle(cluster["prefill"])
