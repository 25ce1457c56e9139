"""``kiln bench serve``: a load generator for any OpenAI-compatible server.

It streams ``num_prompts`` requests of about ``input_len`` prompt tokens and exactly ``output_len``
output tokens (``ignore_eos``, greedy unless ``--temperature`` says otherwise) at most
``max_concurrency`` at a time, then reports throughput and TTFT / TPOT / ITL / E2EL as
``vllm bench serve`` does (see ``kiln.bench.metrics``). Prompt lengths are calibrated with the
server's ``POST /tokenize`` when it has one.

Bounds: it talks only to ``--base-url`` (default: loopback), sends a fixed number of requests, and
each request has a timeout. It knows nothing about the engine: the same run measures Kiln, vLLM or
any server with ``/v1/completions`` or ``/v1/chat/completions``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from kiln.bench.metrics import (
    BenchmarkMetrics,
    RequestResult,
    calculate_metrics,
    format_metrics,
)
from kiln.bench.prompts import CountTokens, Prompt, make_prompts

if TYPE_CHECKING:
    import httpx

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
MAX_NUM_PROMPTS = 100_000
MAX_ERRORS_SHOWN = 10


@dataclass(frozen=True)
class BenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = COMPLETIONS
    model: str | None = None
    """None: the first model of ``GET /v1/models``."""
    num_prompts: int = 64
    input_len: int = 128
    output_len: int = 128
    max_concurrency: int | None = None
    """Most requests in flight at once; None: all of them."""
    request_rate: float = float("inf")
    """Requests started per second (Poisson arrivals); inf: all at once (then the concurrency
    limit paces them)."""
    temperature: float = 0.0
    seed: int = 0
    api_key: str | None = None
    request_timeout: float = 600.0
    """Seconds one request may take, first byte to last."""
    num_warmups: int = 1
    """Requests sent (and not measured) before the run; a failed one stops the benchmark."""
    wait_for_server: float = 0.0
    """Seconds to wait for the server to answer ``/v1/models`` before giving up."""
    disable_tqdm: bool = False

    def __post_init__(self) -> None:
        parsed = urlparse(self.base_url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"base_url must be an http(s) URL, got {self.base_url!r}")
        if self.endpoint not in (COMPLETIONS, CHAT_COMPLETIONS):
            raise ValueError(
                f"endpoint must be {COMPLETIONS!r} or {CHAT_COMPLETIONS!r}, got {self.endpoint!r}"
            )
        if not 1 <= self.num_prompts <= MAX_NUM_PROMPTS:
            raise ValueError(
                f"num_prompts must be in [1, {MAX_NUM_PROMPTS}], got {self.num_prompts}"
            )
        for name in ("input_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency!r}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0, got {self.request_rate!r}")
        if not self.request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0, got {self.request_timeout!r}")
        if self.num_warmups < 0:
            raise ValueError(f"num_warmups must be >= 0, got {self.num_warmups!r}")

    @property
    def root(self) -> str:
        """The server root: ``base_url`` without a trailing ``/`` or ``/v1``."""
        root = self.base_url.rstrip("/")
        return root[: -len("/v1")] if root.endswith("/v1") else root

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


class BenchmarkError(RuntimeError):
    """The server is not there, or not usable for the benchmark (a warm-up request failed)."""


async def wait_for_models(client: httpx.AsyncClient, cfg: BenchConfig) -> list[str]:
    """The ids of ``GET /v1/models``, retried for ``cfg.wait_for_server`` seconds.

    Raises:
        BenchmarkError: no answer in time, or an error status.
    """
    import httpx

    deadline = time.monotonic() + cfg.wait_for_server
    while True:
        try:
            response = await client.get(f"{cfg.root}/v1/models", headers=cfg.headers())
            if response.status_code != 200:
                raise BenchmarkError(
                    f"GET /v1/models answered {response.status_code}: {response.text[:300]}"
                )
            return [entry["id"] for entry in response.json().get("data", [])]
        except httpx.TransportError as exc:
            if time.monotonic() >= deadline:
                raise BenchmarkError(f"no server at {cfg.root}: {exc!r}") from exc
            await asyncio.sleep(1.0)


def token_counter(client: httpx.AsyncClient, cfg: BenchConfig, model: str) -> CountTokens:
    """A ``count_tokens`` for ``make_prompts`` backed by the server's ``POST /tokenize``.

    Completions prompts are counted as the server will tokenize them (with special tokens such
    as BOS); chat contents without, since the chat template adds its own.
    """
    add_special_tokens = cfg.endpoint == COMPLETIONS

    async def count_tokens(text: str) -> int | None:
        # Kiln and vLLM read "prompt" / "add_special_tokens", llama.cpp's server "content" /
        # "add_special": sending both lets one client size prompts the same for all three.
        body = {
            "model": model,
            "prompt": text,
            "add_special_tokens": add_special_tokens,
            "content": text,
            "add_special": add_special_tokens,
        }
        try:
            response = await client.post(f"{cfg.root}/tokenize", json=body, headers=cfg.headers())
        except Exception:
            return None
        if response.status_code != 200:
            return None
        data = response.json()
        if isinstance(data.get("count"), int):
            return int(data["count"])
        tokens = data.get("tokens")
        return len(tokens) if isinstance(tokens, list) else None

    return count_tokens


def request_body(cfg: BenchConfig, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": cfg.temperature,
    }
    if cfg.endpoint == CHAT_COMPLETIONS:
        body["messages"] = [{"role": "user", "content": prompt}]
        body["max_completion_tokens"] = max_tokens
    else:
        body["prompt"] = prompt
        body["max_tokens"] = max_tokens
    return body


def _chunk_text(choice: dict[str, Any]) -> str:
    if "delta" in choice:
        return (choice["delta"] or {}).get("content") or ""
    return choice.get("text") or ""


async def send_request(
    client: httpx.AsyncClient, cfg: BenchConfig, body: dict[str, Any], prompt_len: int
) -> RequestResult:
    """Stream one request and time it; never raises (failures come back in ``error``).

    TTFT is taken at the first chunk with text (a chat's role-only first delta is not a token);
    each later chunk with text adds one ITL gap. Token counts come from the final usage chunk
    when the server sends one, else from the number of chunks with text.
    """
    result = RequestResult(prompt_len=prompt_len)
    url = f"{cfg.root}{cfg.endpoint}"
    start = time.perf_counter()
    last = start
    num_chunks = 0
    usage: dict[str, Any] | None = None
    is_done = False
    try:
        async with client.stream("POST", url, json=body, headers=cfg.headers()) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:300]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, ": comment" keep-alives, "event:" lines
                payload = line[len("data:") :].strip()
                if payload == "[DONE]":
                    is_done = True
                    break
                now = time.perf_counter()
                data = json.loads(payload)
                if "error" in data:
                    result.error = f"error event: {json.dumps(data['error'])[:300]}"
                    return result
                if data.get("usage"):
                    usage = data["usage"]
                choices = data.get("choices") or []
                if choices and _chunk_text(choices[0]):
                    if num_chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    num_chunks += 1
        result.latency = time.perf_counter() - start
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:300]
        return result
    if not is_done:
        result.error = "stream ended without data: [DONE]"
    elif num_chunks == 0:
        result.error = "no output text was streamed"
    else:
        result.success = True
        if usage:
            result.prompt_len = int(usage.get("prompt_tokens") or prompt_len)
            result.output_len = int(usage.get("completion_tokens") or num_chunks)
        else:
            result.output_len = num_chunks
    return result


async def _arrivals(cfg: BenchConfig, rng: random.Random):
    """Sleep between request starts: Poisson arrivals at ``request_rate``, none when infinite."""
    for i in range(cfg.num_prompts):
        if i and cfg.request_rate != float("inf"):
            await asyncio.sleep(rng.expovariate(cfg.request_rate))
        yield i


async def run_benchmark(cfg: BenchConfig) -> dict[str, Any]:
    """Run the benchmark; the result is vLLM's JSON fields plus the run's settings and errors.

    Raises:
        BenchmarkError: the server is unreachable, has no model, or fails the warm-up.
    """
    import httpx
    from tqdm import tqdm

    num_connections = min(cfg.max_concurrency or cfg.num_prompts, cfg.num_prompts)
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(cfg.request_timeout, connect=30.0),
        limits=httpx.Limits(max_connections=num_connections + 1, max_keepalive_connections=None),
        trust_env=False,  # loopback or the URL given: never a proxy from the environment
    ) as client:
        models = await wait_for_models(client, cfg)
        model = cfg.model or (models[0] if models else None)
        if model is None:
            raise BenchmarkError(f"{cfg.root}/v1/models lists no model; pass --model")
        counter = token_counter(client, cfg, model)
        # No /tokenize: one word stands for one token.
        count_tokens = counter if await counter("hello") is not None else None
        # Warm-ups get prompts of their own: a measured prompt seen before would hit the
        # server's prefix cache.
        prompts = await make_prompts(
            cfg.num_prompts + cfg.num_warmups, cfg.input_len, cfg.seed, count_tokens
        )
        warmups, prompts = prompts[cfg.num_prompts :], prompts[: cfg.num_prompts]

        for prompt in warmups:
            warm = await send_request(
                client, cfg, request_body(cfg, model, prompt.text, cfg.output_len), 0
            )
            if not warm.success:
                raise BenchmarkError(f"warm-up request failed: {warm.error}")

        limit = asyncio.Semaphore(cfg.max_concurrency or cfg.num_prompts)
        bar = tqdm(total=cfg.num_prompts, disable=cfg.disable_tqdm, desc="Requests")

        async def one(prompt: Prompt) -> RequestResult:
            async with limit:
                body = request_body(cfg, model, prompt.text, cfg.output_len)
                result = await send_request(client, cfg, body, prompt.num_tokens)
            bar.update(1)
            return result

        start = time.perf_counter()
        tasks = []
        async for i in _arrivals(cfg, random.Random(cfg.seed + 1)):
            tasks.append(asyncio.ensure_future(one(prompts[i])))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()

    metrics = calculate_metrics(results, duration)
    errors = Counter(r.error for r in results if not r.success)
    return {
        "base_url": cfg.root,
        "endpoint": cfg.endpoint,
        "model": model,
        "num_prompts": cfg.num_prompts,
        "input_len": cfg.input_len,
        "output_len": cfg.output_len,
        "max_concurrency": cfg.max_concurrency,
        "request_rate": None if cfg.request_rate == float("inf") else cfg.request_rate,
        "temperature": cfg.temperature,
        "prompt_lens_calibrated": count_tokens is not None,
        **metrics.to_dict(),
        "errors": [
            {"error": error, "count": count}
            for error, count in errors.most_common(MAX_ERRORS_SHOWN)
        ],
    }


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000",
        help="the server (with or without /v1); default: %(default)s",
    )
    parser.add_argument(
        "--endpoint",
        default=COMPLETIONS,
        choices=(COMPLETIONS, CHAT_COMPLETIONS),
        help="the route to load; default: %(default)s",
    )
    parser.add_argument("--model", default=None, help="model name; default: the server's first")
    parser.add_argument("--num-prompts", type=int, default=64, help="requests to send")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    parser.add_argument(
        "--max-concurrency", type=int, default=None, help="most requests in flight (default: all)"
    )
    parser.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second, Poisson arrivals (default: inf, all at once)",
    )
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature (default: greedy)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrivals")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="bearer token (default: $OPENAI_API_KEY)",
    )
    parser.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds per request (600)"
    )
    parser.add_argument(
        "--num-warmups", type=int, default=1, help="unmeasured requests sent first (1)"
    )
    parser.add_argument(
        "--wait-for-server",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="wait this long for the server to come up (default: 0)",
    )
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    parser.add_argument(
        "--json", action="store_true", help="print the result as one JSON object instead"
    )


def main(args: argparse.Namespace) -> int:
    """Run ``kiln bench serve``; exit status 0 when every request succeeded, 1 otherwise."""
    try:
        cfg = BenchConfig(
            base_url=args.base_url,
            endpoint=args.endpoint,
            model=args.model,
            num_prompts=args.num_prompts,
            input_len=args.input_len,
            output_len=args.output_len,
            max_concurrency=args.max_concurrency,
            request_rate=args.request_rate,
            temperature=args.temperature,
            seed=args.seed,
            api_key=args.api_key,
            request_timeout=args.request_timeout,
            num_warmups=args.num_warmups,
            wait_for_server=args.wait_for_server,
            disable_tqdm=args.disable_tqdm,
        )
        result = asyncio.run(run_benchmark(cfg))
    except (ValueError, BenchmarkError) as exc:
        print(f"kiln bench serve: {exc}", file=sys.stderr)
        return 1
    if args.json:
        json.dump(result, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(f"model {result['model']} at {result['base_url']}{result['endpoint']}")
        print(
            f"{cfg.num_prompts} requests, {cfg.input_len} input / {cfg.output_len} output tokens, "
            f"max concurrency {cfg.max_concurrency or 'unlimited'}"
            + ("" if result["prompt_lens_calibrated"] else " (prompt lengths estimated)")
        )
        names = [f.name for f in fields(BenchmarkMetrics)]
        sys.stdout.write(format_metrics(BenchmarkMetrics(**{k: result[k] for k in names})))
        for entry in result["errors"]:
            print(f"error x{entry['count']}: {entry['error']}")
    return 0 if result["failed"] == 0 else 1
