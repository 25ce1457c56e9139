"""Serving throughput with ``--data-parallel-size`` N against 1, measured the same way in one run.

For each repeat, and for each size in ``--sizes`` in turn (interleaved, so a change in the
machine's load hits every size alike): start ``kiln serve --data-parallel-size N`` alone on a free
loopback port with the same flags, run ``kiln bench serve``'s load (``--num-prompts`` streamed
requests of ~``--input-len`` prompt and exactly ``--output-len`` output tokens, greedy,
``ignore_eos``, ``--max-concurrency`` in flight), stop the server. Prints the best output tokens/s
and request throughput of each size over the repeats, and the ratio to the first size.

Each engine gets its share of the cores (``kiln.platforms.worker_cpus``) and of the KV-cache
budget (``--kv-cache-memory`` is the whole server's), so the comparison is at equal memory. On a
2-core machine DP=2 puts one engine on each core, where DP=1's single engine already uses both:
expect no gain there. On a bigger machine, DP helps where one engine cannot use all its cores
(small models, decode-bound load):

    .venv/bin/python benchmarks/data_parallel.py --sizes 1,2,4 --max-concurrency 64 \\
        --num-prompts 256 [--model MODEL] [--serve-args "--dtype bfloat16"]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

from kiln.bench.serve import BenchConfig, run_benchmark
from kiln.testing.server import free_port

START_TIMEOUT_S = 900


def _serve(args: argparse.Namespace, size: int, port: int, log) -> subprocess.Popen:
    command = [sys.executable, "-m", "kiln.entrypoints.cli", "serve"]
    command += [args.model] if args.model else []
    command += ["--data-parallel-size", str(size), "--port", str(port), "--disable-log-stats"]
    command += ["--kv-cache-memory", str(args.kv_cache_memory), *shlex.split(args.serve_args)]
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"kiln serve exited with {proc.returncode}:\n{log.read()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        time.sleep(0.5)
    _stop(proc)
    raise TimeoutError(f"kiln serve --data-parallel-size {size} not healthy")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait(10)


def _measure(args: argparse.Namespace, size: int) -> dict:
    port = free_port()
    with tempfile.TemporaryFile("w+") as log:
        proc = _serve(args, size, port, log)
        try:
            cfg = BenchConfig(
                base_url=f"http://127.0.0.1:{port}",
                num_prompts=args.num_prompts,
                input_len=args.input_len,
                output_len=args.output_len,
                max_concurrency=args.max_concurrency,
                disable_tqdm=True,
            )
            return asyncio.run(run_benchmark(cfg))
        finally:
            _stop(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1,2", help="data-parallel sizes, comma-separated")
    parser.add_argument("--model", default=None, help="default: the embedded default model")
    parser.add_argument("--kv-cache-memory", type=float, default=0.5, help="GiB, whole server")
    parser.add_argument("--serve-args", default="", help="more kiln serve flags")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-concurrency", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    best: dict[int, dict] = {}
    for repeat in range(args.repeats):
        for size in sizes:
            result = _measure(args, size)
            print(
                f"repeat {repeat} DP={size}: {result['output_throughput']:.1f} output tok/s, "
                f"{result['request_throughput']:.2f} req/s, failed {result['failed']}, "
                f"load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
            if size not in best or result["output_throughput"] > best[size]["output_throughput"]:
                best[size] = result
    base = best[sizes[0]]["output_throughput"]
    print(f"\nbest of {args.repeats} (load now {os.getloadavg()[0]:.1f}):")
    for size in sizes:
        tput = best[size]["output_throughput"]
        print(f"  DP={size}: {tput:8.1f} output tok/s  ({tput / base:.2f}x DP={sizes[0]})")


if __name__ == "__main__":
    main()
