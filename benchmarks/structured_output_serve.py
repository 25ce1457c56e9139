"""Benchmark (issue 12): a ``json_schema`` on every served request, and grammar compiles.

Two parts, both on the default model (SmolLM2-135M-Instruct, vocabulary 49,152):

1. Served: a ``kiln serve`` (started here, or ``--base-url``) gets rounds of ``--num-prompts``
   chat requests at ``--concurrency`` (16) in flight, ``--output-len`` tokens each
   (``ignore_eos``), alternately without a constraint and with ``response_format`` ``json_schema``
   (``ORDERS``: an array of 64 orders, longer than any output here, so every request samples
   ``--output-len`` tokens under the grammar). The order of the two modes alternates by round so
   that load drift on a shared machine hits both alike. Per mode it prints the median time per
   output token (TPOT, from the streamed chunks: ``kiln.bench``'s definition), the median TTFT
   and the output throughput, each as the median over the rounds, and json / plain.
2. Compile: the engine core's own ``StructuredOutputManager`` (its thread pool and cache), time
   from ``submit`` (what the scheduler does when a request arrives) to the grammar's first
   matcher: the first compile of the process (it also builds the backend's tokenizer tables),
   a cold compile of a schema not seen before, and a cached one (the same schema again).

The machine's load average is printed with the figures.

Run: ``.venv/bin/python benchmarks/structured_output_serve.py [--rounds 4] [--output-len 64]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx

from kiln.bench.metrics import RequestResult
from kiln.bench.serve import CHAT_COMPLETIONS, BenchConfig, send_request

ORDER_ITEM = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "status": {"enum": ["open", "paid", "shipped", "cancelled"]},
        "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
        "note": {"type": "string", "maxLength": 40},
    },
    "required": ["id", "status", "quantity", "note"],
    "additionalProperties": False,
}
ORDERS = {
    "type": "object",
    "properties": {
        "orders": {"type": "array", "minItems": 64, "maxItems": 64, "items": ORDER_ITEM}
    },
    "required": ["orders"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "orders", "schema": ORDERS}}
CITIES = ["Paris", "Rome", "Berlin", "Madrid", "Lisbon", "Vienna", "Prague", "Oslo"]


def load() -> str:
    return "load {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


# -- 1. served -------------------------------------------------------------------------------


def start_server(port: int, log_path: str) -> subprocess.Popen:
    kiln = os.path.join(os.path.dirname(sys.executable), "kiln")
    command = [kiln, "serve", "--port", str(port), "--disable-log-stats"]
    command += ["--uvicorn-log-level", "warning"]
    log = open(log_path, "w")  # noqa: SIM115 - the server writes it until stopped
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stop_server(server: subprocess.Popen) -> None:
    os.killpg(server.pid, signal.SIGINT)
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def wait_ready(base_url: str, timeout: float) -> str:
    """The served model's id, once ``/v1/models`` answers."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return httpx.get(f"{base_url}/v1/models", timeout=5).json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, ValueError):
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def body(model: str, index: int, output_len: int, structured: bool) -> dict[str, Any]:
    city = CITIES[index % len(CITIES)]
    content = f"List the orders of shop {index} in {city} as JSON."
    out: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_completion_tokens": output_len,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if structured:
        out["response_format"] = RESPONSE_FORMAT
    return out


async def run_round(
    cfg: BenchConfig, model: str, first: int, num_prompts: int, structured: bool
) -> tuple[list[RequestResult], float]:
    limit = asyncio.Semaphore(cfg.max_concurrency or num_prompts)
    async with httpx.AsyncClient(timeout=cfg.request_timeout, trust_env=False) as client:

        async def one(index: int) -> RequestResult:
            async with limit:
                return await send_request(
                    client, cfg, body(model, index, cfg.output_len, structured), 0
                )

        start = time.perf_counter()
        results = await asyncio.gather(*(one(first + i) for i in range(num_prompts)))
        return list(results), time.perf_counter() - start


def served(args: argparse.Namespace) -> None:
    server = None
    base_url = args.base_url
    if base_url is None:
        base_url = f"http://127.0.0.1:{args.port}"
        log_path = os.path.join(tempfile.gettempdir(), f"kiln_so_bench_{args.port}.log")
        server = start_server(args.port, log_path)
        print(f"kiln serve on {base_url} (log: {log_path})", flush=True)
    try:
        model = wait_ready(base_url, args.wait_for_server)
        cfg = BenchConfig(
            base_url=base_url,
            endpoint=CHAT_COMPLETIONS,
            output_len=args.output_len,
            max_concurrency=args.concurrency,
            request_timeout=600.0,
        )
        # Warm-up: both modes once (the grammar compiles and is cached; nothing measured).
        for structured in (False, True):
            results, _ = asyncio.run(run_round(cfg, model, 10_000, args.concurrency, structured))
            errors = [r.error for r in results if not r.success]
            if errors:
                raise RuntimeError(f"warm-up failed: {errors[0]}")
        rows: dict[bool, list[tuple[float, float, float]]] = {False: [], True: []}
        for round_index in range(args.rounds):
            order = (False, True) if round_index % 2 == 0 else (True, False)
            for structured in order:
                first = round_index * args.num_prompts
                results, duration = asyncio.run(
                    run_round(cfg, model, first, args.num_prompts, structured)
                )
                ok = [r for r in results if r.success]
                if len(ok) != len(results):
                    bad = next(r for r in results if not r.success)
                    raise RuntimeError(f"{len(results) - len(ok)} requests failed: {bad.error}")
                tpot = statistics.median(r.tpot for r in ok if r.tpot is not None) * 1000
                ttft = statistics.median(r.ttft for r in ok) * 1000
                throughput = sum(r.output_len for r in ok) / duration
                rows[structured].append((tpot, ttft, throughput))
                name = "json_schema" if structured else "plain"
                print(
                    f"round {round_index} {name:>11}: TPOT {tpot:7.1f} ms  TTFT {ttft:7.1f} ms  "
                    f"{throughput:6.1f} tok/s  ({load()})",
                    flush=True,
                )
        plain = [statistics.median(column) for column in zip(*rows[False], strict=True)]
        json_ = [statistics.median(column) for column in zip(*rows[True], strict=True)]
        print(
            f"\nconcurrency {args.concurrency}, {args.num_prompts} requests x {args.rounds} "
            f"rounds per mode, {args.output_len} output tokens, medians over rounds ({load()})"
        )
        print("| | plain | json_schema | json / plain |")
        print("|---|---|---|---|")
        for label, i in (("TPOT (ms)", 0), ("TTFT (ms)", 1), ("output tok/s", 2)):
            print(f"| {label} | {plain[i]:.1f} | {json_[i]:.1f} | {json_[i] / plain[i]:.3f} |")
    finally:
        if server is not None:
            stop_server(server)


# -- 2. compile ------------------------------------------------------------------------------


def compile_times(args: argparse.Namespace) -> None:
    from kiln.config import KilnConfig
    from kiln.sampling_params import StructuredOutputsParams
    from kiln.structured_output import StructuredOutputManager

    def timed(manager: StructuredOutputManager, schema: dict[str, Any]) -> float:
        start = time.perf_counter()
        future = manager.submit(StructuredOutputsParams(json=schema))
        future.result(timeout=60)
        manager.make_matcher(future)  # what the scheduler waits for
        return (time.perf_counter() - start) * 1000

    def variant(schema: dict[str, Any], i: int) -> dict[str, Any]:
        # A schema not seen before (the cache is keyed by the spec): another title.
        return {**schema, "title": f"variant {i}"}

    manager = StructuredOutputManager(KilnConfig())
    print(f"\ngrammar compile, engine core's StructuredOutputManager ({load()})")
    first = timed(manager, variant(ORDERS, -1))
    print(f"first compile of the process (builds the tokenizer tables): {first:.1f} ms")
    print("| schema | cold (median, max) ms | cached (median) ms |")
    print("|---|---|---|")
    for name, schema in (("ORDERS", ORDERS), ("ORDER_ITEM", ORDER_ITEM)):
        cold = [timed(manager, variant(schema, i)) for i in range(args.compile_repeats)]
        cached = [timed(manager, variant(schema, 0)) for _ in range(args.compile_repeats)]
        print(
            f"| {name} | {statistics.median(cold):.1f}, {max(cold):.1f} | "
            f"{statistics.median(cached):.3f} |"
        )
    manager.shutdown()


# -- 3. the mask's cost per step -------------------------------------------------------------


def mask_cost(args: argparse.Namespace) -> None:
    """CPU time per decode step of the mask at ``--concurrency`` rows: the scheduler's fill (one
    row per request) and matcher advance, and the runner's ``apply_token_bitmask`` on
    [rows, V] logits; main-thread CPU time (``time.thread_time``), so load matters less."""
    import torch

    from kiln.config import KilnConfig
    from kiln.model_executor.layers.token_bitmask import ApplyTokenBitmask
    from kiln.sampling_params import StructuredOutputsParams
    from kiln.structured_output import StructuredOutputManager

    manager = StructuredOutputManager(KilnConfig())
    future = manager.submit(StructuredOutputsParams(json=ORDERS))
    future.result(timeout=60)
    tokenizer = manager._get_tokenizer()
    item = {"id": "ABC-1234", "status": "paid", "quantity": 12, "note": "fragile, ring twice"}
    text = '{"orders": [' + ", ".join(json.dumps(item) for _ in range(8))
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    rows = args.concurrency
    apply = ApplyTokenBitmask()
    logits = torch.randn(rows, manager.vocab_size)
    indices = torch.arange(rows)
    best_fill = best_apply = float("inf")
    for _ in range(3):
        matchers = [manager.make_matcher(future) for _ in range(rows)]
        fill = applied = 0.0
        for token_id in token_ids:
            start = time.thread_time()
            bitmask = manager.fill_bitmask(matchers)
            for matcher in matchers:
                assert matcher.accept_token(token_id)
            middle = time.thread_time()
            apply(logits, torch.from_numpy(bitmask), indices)
            applied += time.thread_time() - middle
            fill += middle - start
        best_fill = min(best_fill, fill / len(token_ids))
        best_apply = min(best_apply, applied / len(token_ids))
    print(
        f"\nmask per step at {rows} rows, V={manager.vocab_size}, best of 3 over {len(token_ids)}"
        f" tokens ({load()}): fill + advance {best_fill * 1000:.2f} ms, "
        f"apply_token_bitmask {best_apply * 1000:.2f} ms (main-thread CPU time)"
    )
    manager.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", default=None, help="a running server; default: start one")
    parser.add_argument("--port", type=int, default=8765, help="port of the server started here")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=32, help="requests per round and mode")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--compile-repeats", type=int, default=5)
    parser.add_argument("--wait-for-server", type=float, default=600.0)
    parser.add_argument("--skip-serve", action="store_true", help="only the compile times")
    args = parser.parse_args()
    if not args.skip_serve:
        served(args)
    compile_times(args)
    mask_cost(args)


if __name__ == "__main__":
    main()
