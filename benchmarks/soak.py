"""Soak test of ``kiln serve``: thousands of mixed requests, memory over time, leaks at the end.

It sends ``--num-requests`` requests (stopping early at ``--duration`` seconds), ``--concurrency``
at a time, each drawn from a seeded mix: completions or chat, streamed or not, ``n`` of 1 to 3,
logprobs (top 0-5, and prompt logprobs through ``echo``), stop strings, temperature 0 or 0.8 with
or without a seed, 1 to ``--max-tokens`` tokens. A ``--disconnect-rate`` share of the requests is
abandoned on purpose: a stream is closed after 0-3 events, a whole answer is given up after a
random 0-300 ms.

While it runs it samples, every ``--sample-interval`` seconds, the resident memory (VmRSS, from
/proc) of the API server and of its engine core, and ``vllm:kv_cache_usage_perc``,
``vllm:num_requests_running`` and ``vllm:num_requests_waiting`` from ``/metrics``. At the end it
waits (``--drain-timeout``) for the engine to go idle and reports whether the KV cache is back to
0, memory growth, and errors by kind. A request counts as an error when it was not abandoned
and did not end well: an HTTP error, a timeout, a transport error, an error event inside a
stream, or a malformed answer (a stream without ``[DONE]``, a choice without ``finish_reason``,
the wrong number of choices).

Server: without ``--base-url`` it starts ``kiln serve`` (default model, ``--server-arg`` adds
flags) on a free loopback port and stops it at the end; with ``--base-url`` it uses a running one
(loopback only), and samples memory only when ``--server-pid`` names its API server.

    .venv/bin/python benchmarks/soak.py --num-requests 2000 --concurrency 16 [--json]

Exit status: 0 when there was no error, the KV cache drained to 0 and the server stayed healthy;
1 otherwise; 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlparse

import httpx

from kiln.bench.prompts import make_prompts
from kiln.testing.server import free_port

MAX_REQUESTS = 100_000
START_TIMEOUT_S = 300
STOP_WORDS = [" the", ".", "\n", " and", ",", " is"]
DEFAULT_SERVER_ARGS = [
    "--max-model-len",
    "512",
    "--kv-cache-memory",
    "0.5",
    "--max-num-seqs",
    "16",
    "--disable-log-stats",
    "--uvicorn-log-level",
    "warning",
]


# ---------------------------------------------------------------------------------------------
# The server and its processes
# ---------------------------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                with open(f"/proc/{entry}/stat") as f:
                    # The command may hold spaces and parentheses: split after the last ")".
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
    return found


def engine_core_pid(server_pid: int) -> int | None:
    """The engine-core child of a ``kiln serve`` (a multiprocessing ``spawn`` child)."""
    for pid in _children(server_pid):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                return pid
    return None


def rss_mib(pid: int | None) -> float | None:
    """Resident memory of ``pid`` in MiB (VmRSS), or None when it is gone or unknown."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


class Server:
    """``kiln serve`` in its own session on a free loopback port."""

    def __init__(self, args: list[str], api_key: str | None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kiln-soak-", suffix=".log")
        command = [sys.executable, "-m", "kiln.entrypoints.cli", "serve", *args]
        command += ["--host", "127.0.0.1", "--port", str(self.port)]
        if api_key:
            command += ["--api-key", api_key]
        self.proc = subprocess.Popen(
            command, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kiln serve exited with {self.proc.returncode}:\n{self.tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.5)
        raise TimeoutError(f"kiln serve not healthy after {timeout} s:\n{self.tail()}")

    def tail(self, chars: int = 3000) -> str:
        self.log.flush()
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()[-chars:]

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(30)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self.log.close()
        return self.proc.returncode


# ---------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """One request of the mix."""

    path: str
    body: dict[str, Any]
    stream: bool
    n: int
    disconnect_after: int | None
    """Streamed: close after this many events; whole: give up after this many ms; None: keep."""


def plan_request(rng: random.Random, prompt: str, model: str, max_tokens: int, rate: float):
    chat = rng.random() < 0.5
    stream = rng.random() < 0.5
    n = 1 if rng.random() < 0.7 else rng.randint(2, 3)
    body: dict[str, Any] = {"model": model, "n": n, "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
        body["max_completion_tokens"] = rng.randint(1, max_tokens)
    else:
        body["prompt"] = prompt
        body["max_tokens"] = rng.randint(1, max_tokens)
    if rng.random() < 0.5:
        body["temperature"] = 0.0
    else:
        body["temperature"] = 0.8
        if rng.random() < 0.5:
            body["seed"] = rng.randint(0, 2**31)
    if rng.random() < 0.25:
        top = rng.randint(0, 5)
        if chat:
            body["logprobs"] = True
            body["top_logprobs"] = top
        else:
            body["logprobs"] = top
            # Prompt logprobs through echo, as lm-eval asks for them.
            body["echo"] = not stream and rng.random() < 0.5
    if rng.random() < 0.25:
        body["stop"] = rng.sample(STOP_WORDS, rng.randint(1, 3))
    if stream and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    disconnect = None
    if rng.random() < rate:
        disconnect = rng.randint(0, 3) if stream else rng.randint(0, 300)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return Plan(path, body, stream, n, disconnect)


def _finished(choices: list[dict[str, Any]], n: int) -> str | None:
    """Why a set of final choices is malformed, or None."""
    if sorted(c.get("index") for c in choices) != list(range(n)):
        return f"choices {sorted(c.get('index') for c in choices)} for n={n}"
    if any(c.get("finish_reason") not in ("stop", "length") for c in choices):
        return f"finish_reason {[c.get('finish_reason') for c in choices]}"
    return None


async def run_one(client: httpx.AsyncClient, plan: Plan, timeout: float) -> str:
    """Send ``plan``; returns "ok", "abandoned" or the kind of error (``kind: detail``)."""
    try:
        if not plan.stream:
            post = client.post(plan.path, json=plan.body, timeout=timeout)
            if plan.disconnect_after is not None:
                try:
                    response = await asyncio.wait_for(post, plan.disconnect_after / 1000)
                except TimeoutError:
                    return "abandoned"
            else:
                response = await post
            if response.status_code != 200:
                return f"http {response.status_code}: {response.text[:200]}"
            problem = _finished(response.json().get("choices", []), plan.n)
            return f"bad answer: {problem}" if problem else "ok"
        async with client.stream("POST", plan.path, json=plan.body, timeout=timeout) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                return f"http {response.status_code}: {text[:200]}"
            events = 0
            finish: dict[int, dict[str, Any]] = {}
            done = False
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if plan.disconnect_after is not None and events >= plan.disconnect_after:
                    return "abandoned"  # leaving the block closes the connection mid-stream
                events += 1
                payload = line[len("data: ") :]
                if payload == "[DONE]":
                    done = True
                    break
                event = json.loads(payload)
                if "error" in event:
                    return f"in-stream error: {str(event['error'].get('message'))[:200]}"
                for choice in event.get("choices", []):
                    if choice.get("finish_reason") is not None:
                        finish[choice["index"]] = choice
            if plan.disconnect_after is not None and not done:
                return "abandoned"
            if not done:
                return "bad answer: stream ended without [DONE]"
            problem = _finished(list(finish.values()), plan.n)
            return f"bad answer: {problem}" if problem else "ok"
    except httpx.TimeoutException:
        return "timeout"
    except httpx.TransportError as exc:
        return f"transport: {type(exc).__name__}"


# ---------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")
GAUGES = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting")


async def scrape(client: httpx.AsyncClient) -> dict[str, float]:
    """The gauges in ``GAUGES`` (summed over labels); empty when /metrics does not answer."""
    try:
        response = await client.get("/metrics", timeout=10)
    except httpx.HTTPError:
        return {}
    if response.status_code != 200:
        return {}
    values: dict[str, float] = {}
    for line in response.text.splitlines():
        match = _SAMPLE.match(line)
        if match and match.group(1) in GAUGES:
            values[match.group(1)] = values.get(match.group(1), 0.0) + float(match.group(3))
    return values


@dataclass
class Sample:
    t_s: float
    requests_done: int
    api_rss_mib: float | None
    engine_rss_mib: float | None
    kv_usage: float | None
    running: float | None
    waiting: float | None


@dataclass
class Report:
    base_url: str
    requests_planned: int
    requests_sent: int = 0
    ok: int = 0
    abandoned: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    error_examples: dict[str, str] = field(default_factory=dict)
    mix: dict[str, int] = field(default_factory=dict)
    duration_s: float = 0.0
    requests_per_s: float = 0.0
    samples: list[Sample] = field(default_factory=list)
    kv_usage_max: float | None = None
    kv_usage_end: float | None = None
    running_end: float | None = None
    waiting_end: float | None = None
    drain_s: float | None = None
    health_end: int | None = None
    server_exit_code: int | None = None

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    @property
    def passed(self) -> bool:
        return (
            self.error_count == 0
            and self.kv_usage_end == 0
            and self.running_end == 0
            and self.waiting_end == 0
            and self.health_end == 200
        )

    def memory(self, key: str) -> dict[str, float] | None:
        """First, peak and last sample of ``key`` and its growth (MiB).

        ``growth_after_settled`` runs from the sample a tenth into the run (allocators and caches
        fill first); ``growth_second_half`` from the middle sample, the one to watch for a leak:
        a leak keeps growing with the requests, a warm-up flattens out.
        """
        values = [getattr(s, key) for s in self.samples if getattr(s, key) is not None]
        if not values:
            return None
        settled = values[len(values) // 10]
        middle = values[len(values) // 2]
        return {
            "first": values[0],
            "settled": settled,
            "middle": middle,
            "peak": max(values),
            "last": values[-1],
            "growth_after_settled": values[-1] - settled,
            "growth_second_half": values[-1] - middle,
        }

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["error_count"] = self.error_count
        out["passed"] = self.passed
        out["api_rss_mib"] = self.memory("api_rss_mib")
        out["engine_rss_mib"] = self.memory("engine_rss_mib")
        return out


def format_report(report: Report, rows: int = 12) -> str:
    lines = [
        f"soak against {report.base_url}: {report.requests_sent} of {report.requests_planned} "
        f"requests in {report.duration_s:.0f} s ({report.requests_per_s:.1f} req/s)",
        f"  ok {report.ok}, abandoned on purpose {report.abandoned}, errors {report.error_count}",
        "  mix: " + ", ".join(f"{k} {v}" for k, v in sorted(report.mix.items())),
    ]
    for kind, count in sorted(report.errors.items(), key=lambda item: -item[1]):
        lines.append(f"  error {kind}: {count}x, e.g. {report.error_examples[kind]}")
    for key, name in (("api_rss_mib", "API server"), ("engine_rss_mib", "engine core")):
        memory = report.memory(key)
        if memory is None:
            lines.append(f"  {name} RSS: not sampled")
        else:
            lines.append(
                f"  {name} RSS MiB: first {memory['first']:.0f}, after warm-up "
                f"{memory['settled']:.0f}, peak {memory['peak']:.0f}, last {memory['last']:.0f} "
                f"(growth after warm-up {memory['growth_after_settled']:+.1f}, over the second "
                f"half {memory['growth_second_half']:+.1f})"
            )
    kv_max = "n/a" if report.kv_usage_max is None else f"{report.kv_usage_max:.1%}"
    drain = "n/a" if report.drain_s is None else f"{report.drain_s:.1f} s"
    lines.append(
        f"  KV usage: peak {kv_max}, at the end {report.kv_usage_end} (running "
        f"{report.running_end}, waiting {report.waiting_end}; idle {drain} after the last "
        f"request); /health {report.health_end}"
    )
    if report.samples:
        lines.append("  t(s)  done  API MiB  engine MiB  KV use  running  waiting")
        step = max(1, len(report.samples) // rows)
        picked = report.samples[::step]
        if picked[-1] is not report.samples[-1]:
            picked.append(report.samples[-1])

        def num(value: float | None, fmt: str) -> str:
            return "-" if value is None else format(value, fmt)

        for s in picked:
            lines.append(
                f"  {s.t_s:4.0f} {s.requests_done:5d} {num(s.api_rss_mib, '8.0f')} "
                f"{num(s.engine_rss_mib, '11.0f')} {num(s.kv_usage, '7.1%')} "
                f"{num(s.running, '8.0f')} {num(s.waiting, '8.0f')}"
            )
    lines.append("PASSED" if report.passed else "FAILED")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


async def soak(args: argparse.Namespace, base_url: str, server_pid: int | None) -> Report:
    rng = random.Random(args.seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    report = Report(base_url=base_url, requests_planned=args.num_requests)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits) as client:
        models = (await client.get("/v1/models", timeout=30)).json()
        model = models["data"][0]["id"]
        prompts = [
            p.text
            for p in await make_prompts(64, args.prompt_len, seed=args.seed, count_tokens=None)
        ]
        # Prompts of 1 to prompt_len words: cut from the longer ones.
        plans = []
        for _ in range(args.num_requests):
            words = rng.choice(prompts).split()[: rng.randint(1, args.prompt_len)]
            plan = plan_request(rng, " ".join(words), model, args.max_tokens, args.disconnect_rate)
            plans.append(plan)
        engine_pid = engine_core_pid(server_pid) if server_pid else None
        start = time.monotonic()
        deadline = start + args.duration
        next_index = 0
        done = 0

        async def sample() -> Sample:
            values = await scrape(client)
            return Sample(
                t_s=round(time.monotonic() - start, 2),
                requests_done=done,
                api_rss_mib=rss_mib(server_pid),
                engine_rss_mib=rss_mib(engine_pid),
                kv_usage=values.get("vllm:kv_cache_usage_perc"),
                running=values.get("vllm:num_requests_running"),
                waiting=values.get("vllm:num_requests_waiting"),
            )

        async def sampler() -> None:
            while True:
                report.samples.append(await sample())
                await asyncio.sleep(args.sample_interval)

        async def worker() -> None:
            nonlocal next_index, done
            while next_index < len(plans) and time.monotonic() < deadline:
                plan = plans[next_index]
                next_index += 1
                kind = "chat" if plan.path.endswith("chat/completions") else "completions"
                mix = f"{kind}{' stream' if plan.stream else ''}"
                report.mix[mix] = report.mix.get(mix, 0) + 1
                report.requests_sent += 1
                outcome = await run_one(client, plan, args.request_timeout)
                done += 1
                if outcome == "ok":
                    report.ok += 1
                elif outcome == "abandoned":
                    report.abandoned += 1
                else:
                    error_kind = outcome.split(":", 1)[0]
                    report.errors[error_kind] = report.errors.get(error_kind, 0) + 1
                    report.error_examples.setdefault(
                        error_kind, f"{outcome} <- {json.dumps(plan.body)[:300]}"
                    )

        sampling = asyncio.create_task(sampler())
        try:
            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
            report.duration_s = time.monotonic() - start
            report.requests_per_s = report.requests_sent / max(report.duration_s, 1e-9)
            # Idle: nothing running or waiting and every KV block free, within drain_timeout.
            finished = time.monotonic()
            while True:
                last = await sample()
                idle = last.kv_usage == 0 and last.running == 0 and last.waiting == 0
                if idle or time.monotonic() - finished > args.drain_timeout:
                    break
                await asyncio.sleep(0.1)
            report.drain_s = time.monotonic() - finished if idle else None
        finally:
            sampling.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampling
        report.samples.append(last)
        report.kv_usage_end = last.kv_usage
        report.running_end = last.running
        report.waiting_end = last.waiting
        kv_values = [s.kv_usage for s in report.samples if s.kv_usage is not None]
        report.kv_usage_max = max(kv_values) if kv_values else None
        with contextlib.suppress(httpx.HTTPError):
            report.health_end = (await client.get("/health", timeout=10)).status_code
    return report


def _is_loopback(url: str) -> bool:
    host = urlparse(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-url", help="a running server (loopback); default: start one")
    parser.add_argument("--server-pid", type=int, help="API server pid of --base-url (for RSS)")
    parser.add_argument("--server-arg", action="append", default=[], help="extra kiln serve flag")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--duration", type=float, default=900, help="stop sending after (s)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64, help="most prompt words")
    parser.add_argument("--disconnect-rate", type=float, default=0.1)
    parser.add_argument("--request-timeout", type=float, default=120)
    parser.add_argument("--sample-interval", type=float, default=1.0)
    parser.add_argument("--drain-timeout", type=float, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    if not 1 <= args.num_requests <= MAX_REQUESTS:
        parser.error(f"--num-requests must be in [1, {MAX_REQUESTS}], got {args.num_requests}")
    if not 0 < args.duration <= 24 * 3600:
        parser.error(f"--duration must be in (0, 86400] seconds, got {args.duration}")
    for name in ("concurrency", "max_tokens", "prompt_len"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.disconnect_rate <= 1:
        parser.error(f"--disconnect-rate must be in [0, 1], got {args.disconnect_rate}")
    for name in ("request_timeout", "sample_interval"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.base_url and not _is_loopback(args.base_url):
        parser.error(f"--base-url must be a loopback address, got {args.base_url}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    server = None
    if args.base_url:
        base_url, server_pid = args.base_url.rstrip("/"), args.server_pid
    else:
        server = Server([*DEFAULT_SERVER_ARGS, *args.server_arg], args.api_key)
        base_url, server_pid = server.url, server.proc.pid
    try:
        if server is not None:
            server.wait_healthy()
            print(f"kiln serve is up at {base_url}", file=sys.stderr, flush=True)
        report = asyncio.run(soak(args, base_url, server_pid))
    finally:
        exit_code = server.stop() if server is not None else None
    report.server_exit_code = exit_code
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_report(report))
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
