"""Benchmark (issue 27): the Responses API's overhead against chat completions for the same
request, at ``--concurrency`` (16) requests in flight.

A ``kiln serve`` of the default model (started here, or ``--base-url``) gets rounds of
``--num-requests`` requests: the same greedy conversations once through
``POST /v1/chat/completions`` and once through ``POST /v1/responses`` (``store: false``, so the
store costs nothing the chat side lacks), ``--output-len`` tokens at most each, non-streaming or
(``--stream``) streaming. Greedy answers of the two routes are equal, so both modes generate the
same tokens; the order of the modes alternates by round so that load drift on a shared machine
hits both alike. Per mode it prints the median over rounds of the round's wall time and its
requests per second, then responses / chat. The machine's load average is printed with them:
on a loaded machine the figures mean little.

Run: ``.venv/bin/python benchmarks/responses_overhead.py [--rounds 4] [--num-requests 64]``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from typing import Any

import httpx

PROMPTS = [
    f"Write one sentence about {topic}."
    for topic in ("rivers", "bread", "trains", "owls", "glass", "maps", "tides", "salt")
]


def load() -> str:
    return "load {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def body(mode: str, index: int, args: argparse.Namespace) -> dict[str, Any]:
    prompt = PROMPTS[index % len(PROMPTS)]
    common = {"model": args.model, "temperature": 0, "stream": args.stream}
    if mode == "chat":
        messages = [{"role": "user", "content": prompt}]
        return {**common, "messages": messages, "max_completion_tokens": args.output_len}
    return {**common, "input": prompt, "max_output_tokens": args.output_len, "store": False}


async def one_round(http: httpx.AsyncClient, mode: str, args: argparse.Namespace) -> float:
    """Seconds for ``--num-requests`` requests of ``mode`` at ``--concurrency``."""
    path = "/v1/chat/completions" if mode == "chat" else "/v1/responses"
    gate = asyncio.Semaphore(args.concurrency)

    async def send(index: int) -> None:
        async with gate:
            if args.stream:
                async with http.stream("POST", path, json=body(mode, index, args)) as answer:
                    answer.raise_for_status()
                    async for _ in answer.aiter_bytes():
                        pass
            else:
                (await http.post(path, json=body(mode, index, args))).raise_for_status()

    start = time.perf_counter()
    await asyncio.gather(*(send(i) for i in range(args.num_requests)))
    return time.perf_counter() - start


async def run(url: str, args: argparse.Namespace) -> None:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600, limits=limits) as http:
        if args.model is None:
            args.model = (await http.get("/v1/models")).json()["data"][0]["id"]
        for mode in ("chat", "responses"):  # warm-up: templates, caches, connections
            await one_round(http, mode, args)
        times: dict[str, list[float]] = {"chat": [], "responses": []}
        for index in range(args.rounds):
            order = ("chat", "responses") if index % 2 == 0 else ("responses", "chat")
            for mode in order:
                times[mode].append(await one_round(http, mode, args))
    print(f"{args.num_requests} requests per round, concurrency {args.concurrency}, {load()}")
    medians = {mode: statistics.median(values) for mode, values in times.items()}
    for mode, seconds in medians.items():
        print(f"{mode:>10}: {seconds:.3f} s per round, {args.num_requests / seconds:.1f} req/s")
    print(f"responses / chat: {medians['responses'] / medians['chat']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", help="a running kiln serve (default: start one here)")
    parser.add_argument("--api-key", default=None, help="its API key, if it has one")
    parser.add_argument("--model", default=None, help="the model name (default: the served one)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per mode (default: 4)")
    parser.add_argument("--num-requests", type=int, default=64, help="requests per round")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    parser.add_argument("--output-len", type=int, default=32, help="max tokens per answer")
    parser.add_argument("--stream", action="store_true", help="stream both routes' answers")
    args = parser.parse_args()
    if args.base_url:
        asyncio.run(run(args.base_url, args))
        return
    from kiln.testing.server import KilnServer

    server = KilnServer(["--max-num-seqs", str(args.concurrency), "--disable-log-stats"])
    try:
        asyncio.run(run(server.url, args))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
