"""Latency and throughput statistics of a serving benchmark, computed from per-request timings.

Contract: pure functions over plain numbers. The definitions are vLLM's (``vllm bench serve``), so
results from either tool compare directly:

- TTFT (time to first token): request sent -> first streamed chunk that carries a choice.
- TPOT (time per output token) of one request: ``(latency - ttft) / (output_tokens - 1)``; a
  request with a single output token has none.
- ITL (inter-token latency): every gap between consecutive streamed chunks, over all requests.
- E2EL: request sent -> last byte of the response.
- Throughputs divide totals over successful requests by the wall time of the whole run.

Percentiles interpolate linearly between closest ranks, as ``numpy.percentile`` does by default.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field


@dataclass
class RequestResult:
    """What one benchmark request measured. Times are seconds."""

    success: bool = False
    prompt_len: int = 0
    """Prompt tokens: the server's ``usage.prompt_tokens`` when it sent usage, else the estimate."""
    output_len: int = 0
    """Output tokens: ``usage.completion_tokens`` when sent, else the number of content chunks."""
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    """Gaps between consecutive content chunks after the first."""
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None with fewer than two tokens."""
        if not self.success or self.output_len < 2:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values`` with linear interpolation; 0.0 when empty.

    Raises:
        ValueError: ``q`` outside [0, 100].
    """
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q!r}")
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


@dataclass
class BenchmarkMetrics:
    """The summary of a run; times in milliseconds, throughputs per second (vLLM's field names)."""

    completed: int
    failed: int
    duration: float
    """Wall time of the run in seconds."""
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    mean_ttft_ms: float
    median_ttft_ms: float
    p99_ttft_ms: float
    mean_tpot_ms: float
    median_tpot_ms: float
    p99_tpot_ms: float
    mean_itl_ms: float
    median_itl_ms: float
    p99_itl_ms: float
    mean_e2el_ms: float
    median_e2el_ms: float
    p99_e2el_ms: float

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


def _stats_ms(values: Sequence[float]) -> tuple[float, float, float]:
    """(mean, median, p99) of ``values`` (seconds) in milliseconds."""
    return (mean(values) * 1000, percentile(values, 50) * 1000, percentile(values, 99) * 1000)


def calculate_metrics(results: Sequence[RequestResult], duration: float) -> BenchmarkMetrics:
    """Summarise ``results`` of a run that took ``duration`` seconds.

    Failed requests count in ``failed`` only: they add no tokens and no latencies.

    Raises:
        ValueError: ``duration`` is not positive.
    """
    if duration <= 0:
        raise ValueError(f"duration must be > 0 seconds, got {duration!r}")
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_len for r in ok)
    tpots = [t for r in ok if (t := r.tpot) is not None]
    ttft = _stats_ms([r.ttft for r in ok])
    tpot = _stats_ms(tpots)
    itl = _stats_ms([gap for r in ok for gap in r.itl])
    e2el = _stats_ms([r.latency for r in ok])
    return BenchmarkMetrics(
        completed=len(ok),
        failed=len(results) - len(ok),
        duration=duration,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(ok) / duration,
        output_throughput=output_tokens / duration,
        total_token_throughput=(input_tokens + output_tokens) / duration,
        mean_ttft_ms=ttft[0],
        median_ttft_ms=ttft[1],
        p99_ttft_ms=ttft[2],
        mean_tpot_ms=tpot[0],
        median_tpot_ms=tpot[1],
        p99_tpot_ms=tpot[2],
        mean_itl_ms=itl[0],
        median_itl_ms=itl[1],
        p99_itl_ms=itl[2],
        mean_e2el_ms=e2el[0],
        median_e2el_ms=e2el[1],
        p99_e2el_ms=e2el[2],
    )


def format_metrics(metrics: BenchmarkMetrics, title: str = "Serving Benchmark Result") -> str:
    """The human-readable report (the layout of ``vllm bench serve``)."""
    lines = [f"{f' {title} ':=^60}"]

    def row(label: str, value: float | int, fmt: str = ".2f") -> None:
        lines.append(f"{label:<44}{value:>16{fmt}}")

    row("Successful requests:", metrics.completed, "d")
    row("Failed requests:", metrics.failed, "d")
    row("Benchmark duration (s):", metrics.duration)
    row("Total input tokens:", metrics.total_input_tokens, "d")
    row("Total generated tokens:", metrics.total_output_tokens, "d")
    row("Request throughput (req/s):", metrics.request_throughput)
    row("Output token throughput (tok/s):", metrics.output_throughput)
    row("Total token throughput (tok/s):", metrics.total_token_throughput)
    for name, key in (
        ("Time to First Token", "ttft"),
        ("Time per Output Token (excl. 1st token)", "tpot"),
        ("Inter-token Latency", "itl"),
        ("End-to-end Latency", "e2el"),
    ):
        lines.append(f"{f' {name} ':-^60}")
        for stat in ("mean", "median", "p99"):
            label = "P99" if stat == "p99" else stat.capitalize()
            row(f"{label} {key.upper()} (ms):", getattr(metrics, f"{stat}_{key}_ms"))
    lines.append("=" * 60)
    return "\n".join(lines) + "\n"
