"""Disaggregated prefill (1P1D through ``kiln proxy``) against one instance of the same cores.

The workload mixes ``--long-prompts`` prompts of about ``--long-tokens`` tokens with
``--chats`` short chats (``--chat-tokens`` prompt tokens, ``--answer-tokens`` answer tokens,
``ignore_eos``), all sent at once, streamed, greedy. The figure is the p99 inter-token latency
of the short chats (the gaps between their streamed chunks): on one instance a long prompt's
prefill stalls every running decode; with 1P1D the decode instance only copies its KV in.

- **1P1D:** a prefill instance (``P2pConnector`` ``kv_producer``) on the first half of
  ``--cpus`` and a decode instance (``kv_consumer``) on the second half, behind ``kiln proxy``;
- **one instance:** ``kiln serve`` on all of ``--cpus``.

    .venv/bin/python benchmarks/disagg_prefill.py [--cpus 0-15] [--long-prompts 4]
        [--long-tokens 2000] [--chats 16] [--answer-tokens 64]

Each instance is pinned with ``taskset`` (Linux). Run it on an idle machine: the two setups are
compared in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai

from kiln.testing.server import free_port


def parse_cpus(text: str) -> list[int]:
    """``0-3,8`` -> [0, 1, 2, 3, 8]."""
    cpus: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        cpus += range(int(first), int(last or first) + 1)
    return cpus


def launch(args: list[str], cpus: list[int], log: str) -> tuple[subprocess.Popen, str]:
    """``kiln ARGS`` pinned to ``cpus`` (``serve`` gets a port); returns it and its URL."""
    port = free_port()
    command = ["taskset", "-c", ",".join(map(str, cpus)), sys.executable, "-m"]
    command += ["kiln.entrypoints.cli", *args, "--port", str(port)]
    env = {**os.environ, "OMP_NUM_THREADS": str(len(cpus))}
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{' '.join(args[:1])} exited; see {log}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy; see {log}")


def serve_args(args: argparse.Namespace, role: str | None, kv_port: int = 0) -> list[str]:
    command = ["serve", "--dtype", args.dtype, "--max-model-len", str(args.long_tokens + 512)]
    if role is not None:
        extra = {"kv_port": kv_port} if role == "kv_producer" else {}
        config = {"kv_connector": "P2pConnector", "kv_role": role}
        command += [
            "--kv-transfer-config",
            json.dumps({**config, "kv_connector_extra_config": extra}),
        ]
    return command


@contextmanager
def setup(args: argparse.Namespace, kind: str, log_dir: str) -> Iterator[str]:
    """The URL of the 1P1D proxy ("1p1d") or of one instance ("single"), up until exit."""
    cpus = parse_cpus(args.cpus)
    processes = []
    try:
        if kind == "single":
            process, url = launch(serve_args(args, None), cpus, f"{log_dir}/single.log")
            processes.append(process)
        else:
            half = max(len(cpus) // 2, 1)
            kv_port = free_port()
            prefill_args = serve_args(args, "kv_producer", kv_port)
            prefill, prefill_url = launch(prefill_args, cpus[:half], f"{log_dir}/prefill.log")
            processes.append(prefill)
            decode_args = serve_args(args, "kv_consumer")
            decode, decode_url = launch(decode_args, cpus[half:] or cpus, f"{log_dir}/decode.log")
            processes.append(decode)
            proxy_args = ["proxy", "--prefill", prefill_url, "--decode", decode_url]
            proxy, url = launch(proxy_args, cpus, f"{log_dir}/proxy.log")
            processes.append(proxy)
        yield url
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(30)


def long_prompt(i: int, num_tokens: int) -> str:
    words = " ".join(
        f"record {i}-{j} reads {j * 7 % 1000} degrees;" for j in range(num_tokens // 8)
    )
    return f"Summarise the kiln log {i}: {words}"


def run_workload(url: str, args: argparse.Namespace) -> list[float]:
    """Send the mix at once; returns the short chats' inter-token gaps in seconds."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=1800)
    model = client.models.list().data[0].id
    gaps: list[float] = []
    lock = threading.Lock()

    def chat(i: int) -> None:
        content = f"Chat {i}: " + "tell me about glazes and clay " * (args.chat_tokens // 6)
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": content}],
            max_tokens=args.answer_tokens,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        last, mine = None, []
        for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].delta.content:
                if last is not None:
                    mine.append(now - last)
                last = now
        with lock:
            gaps.extend(mine)

    def prefill(i: int) -> None:
        client.completions.create(
            model=model, prompt=long_prompt(i, args.long_tokens), max_tokens=4, temperature=0
        )

    threads = [threading.Thread(target=chat, args=(i,)) for i in range(args.chats)]
    # Long prompts start once the chats decode, so each prefill lands among running decodes.
    threads += [threading.Thread(target=prefill, args=(i,)) for i in range(args.long_prompts)]
    for n, thread in enumerate(threads):
        thread.start()
        if n == args.chats - 1:
            time.sleep(args.stagger)
    for thread in threads:
        thread.join()
    return gaps


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98] if len(values) > 1 else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpus", default=f"0-{(os.cpu_count() or 2) - 1}")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--long-prompts", type=int, default=4)
    parser.add_argument("--long-tokens", type=int, default=2000)
    parser.add_argument("--chats", type=int, default=16)
    parser.add_argument("--chat-tokens", type=int, default=48)
    parser.add_argument("--answer-tokens", type=int, default=64)
    parser.add_argument("--stagger", type=float, default=1.0, help="seconds between the mixes")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="kiln-disagg-") as log_dir:
        for kind in ("single", "1p1d"):
            with setup(args, kind, log_dir) as url:
                run_workload(url, argparse.Namespace(**{**vars(args), "long_prompts": 0}))
                gaps = run_workload(url, args)
            results[kind] = gaps
            print(
                f"{kind:>6}: p99 ITL {p99(gaps) * 1e3:8.1f} ms, median "
                f"{statistics.median(gaps) * 1e3:6.1f} ms ({len(gaps)} gaps)"
            )
    ratio = p99(results["single"]) / p99(results["1p1d"])
    print(f"1P1D p99 ITL is {ratio:.2f}x lower than one instance's")


if __name__ == "__main__":
    main()
