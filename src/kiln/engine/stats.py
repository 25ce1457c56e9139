"""Engine statistics: running counters, and a log line every ``interval`` seconds while busy.

``StatsRecorder.record`` takes what the scheduler (``SchedulerStats``) and the output processor
(``IterationStats``) report each step. It keeps totals (what ``/metrics`` exports) and logs::

    Engine: prompt 812.3 tok/s, generation 95.1 tok/s | running 16, waiting 0 | KV cache 12.5% |
    prefix cache hit rate 43.0% | preemptions 0 | spec decode: acceptance rate 61.3%, mean
    accepted length 3.45 | KV connector: 320 tokens supplied, 20 blocks loaded, 31 saved

(the speculative-decoding part only while drafts were verified in the window: the share of draft
tokens accepted, and the tokens a verifying request gained per step, its bonus token included,
as vLLM's "mean acceptance length"; the KV connector's part only while it moved blocks).

With data parallelism each engine core has its own totals (``engines[i]``, fed by the outputs
whose ``engine_index`` is ``i``); ``totals`` is their sum, which the log line shows.

This module knows nothing about Prometheus; the server's metrics module reads the totals and
registers a listener (``add_listener``) for what totals cannot hold (latency histograms).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kiln.messages import FinishReason, SchedulerStats

logger = logging.getLogger("kiln.engine")


@dataclass
class FinishedRequestStats:
    """One finished engine-core request, for the latency and finish-reason metrics.

    Its life as vLLM splits it: ``queued_time`` (arrival to first scheduled), then
    ``inference_time`` (first scheduled to last token) = ``prefill_time`` (to the first token) +
    ``decode_time`` (first to last token). A phase it never reached lasts 0 and the phase it was
    in ends at the finish (an abort while waiting is all queue time).
    """

    request_id: str
    finish_reason: FinishReason
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    time_to_first_token: float | None
    mean_inter_token_latency: float | None
    queued_time: float = 0.0
    prefill_time: float = 0.0
    decode_time: float = 0.0
    inference_time: float = 0.0
    max_tokens_param: int | None = None
    """The request's ``max_tokens`` (None: up to the context length)."""


@dataclass
class IterationStats:
    """What one ``process_outputs`` call saw, ready to feed into Prometheus counters/histograms."""

    iteration_timestamp: float
    num_prompt_tokens: int = 0
    """Prompt tokens of the requests that got their first token in this iteration."""
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    max_num_generation_tokens: list[int] = field(default_factory=list)
    """Per finished client request (all its ``n`` completions done): the most tokens one of its
    completions generated."""
    n_params: list[int] = field(default_factory=list)
    """Per finished client request: its ``n``."""


StatsListener = Callable[[SchedulerStats | None, IterationStats | None, int], None]
"""``listener(scheduler_stats, iteration_stats, engine_index)``."""


@dataclass
class StatsTotals:
    """Counters since start, and the latest gauges."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    finished_by_reason: dict[str, int] = field(default_factory=dict)
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    spec_num_drafts: int = 0
    """Speculative decoding: request-steps that verified drafts."""
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    kv_connector: dict[str, float] = field(default_factory=dict)
    """The KV connector's counters (``kiln.kv_transfer.STAT_NAMES``), summed."""


def spec_decode_rates(
    num_drafts: int, num_draft_tokens: int, num_accepted: int
) -> tuple[float, float]:
    """``(acceptance rate, mean accepted length)``: the share of draft tokens accepted, and the
    tokens per verifying step (accepted drafts plus the one more each step emits); 0s without
    drafts."""
    if not num_drafts:
        return 0.0, 0.0
    return num_accepted / max(num_draft_tokens, 1), 1 + num_accepted / num_drafts


def sum_totals(engines: list[StatsTotals]) -> StatsTotals:
    """The totals of several engines as one: counts and gauges added, KV-cache usage averaged
    (every engine has a cache of the same size)."""
    total = StatsTotals()
    for t in engines:
        total.prompt_tokens += t.prompt_tokens
        total.generation_tokens += t.generation_tokens
        total.preemptions += t.preemptions
        total.prefix_cache_queries += t.prefix_cache_queries
        total.prefix_cache_hits += t.prefix_cache_hits
        for reason, count in t.finished_by_reason.items():
            total.finished_by_reason[reason] = total.finished_by_reason.get(reason, 0) + count
        total.num_running += t.num_running
        total.num_waiting += t.num_waiting
        total.spec_num_drafts += t.spec_num_drafts
        total.spec_num_draft_tokens += t.spec_num_draft_tokens
        total.spec_num_accepted_tokens += t.spec_num_accepted_tokens
        _add(total.kv_connector, t.kv_connector)
    total.kv_cache_usage = sum(t.kv_cache_usage for t in engines) / max(1, len(engines))
    return total


def _add(totals: dict[str, float], counts: dict[str, float]) -> None:
    for name, value in counts.items():
        totals[name] = totals.get(name, 0) + value


class StatsRecorder:
    """Accumulates engine statistics and logs them periodically.

    Args:
        interval: seconds between log lines; 0 disables logging (totals are still kept).
        num_engines: engine cores whose statistics are kept apart (``parallel.data_parallel_size``).
    """

    def __init__(self, interval: float = 10.0, num_engines: int = 1) -> None:
        self.interval = interval
        self.engines = [StatsTotals() for _ in range(num_engines)]
        """Each engine core's totals, by engine index."""
        self._window_start = time.monotonic()
        self._window_prompt = 0
        self._window_generation = 0
        self._window_queries = 0
        self._window_hits = 0
        self._window_spec = [0, 0, 0]  # drafts, draft tokens, accepted tokens
        self._window_connector: dict[str, float] = {}
        self._listeners: list[StatsListener] = []

    @property
    def totals(self) -> StatsTotals:
        """Every engine's totals together (the one engine's own object when there is one)."""
        return self.engines[0] if len(self.engines) == 1 else sum_totals(self.engines)

    def add_listener(self, listener: StatsListener) -> None:
        """Call ``listener(scheduler_stats, iteration_stats, engine_index)`` on every ``record``,
        after the totals are updated. A listener that raises is logged, never propagated."""
        self._listeners.append(listener)

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        now: float | None = None,
        engine_index: int = 0,
    ) -> None:
        """Add one step's statistics of engine ``engine_index``; may log. Side effects: updates
        ``engines[engine_index]``."""
        t = self.engines[engine_index]
        if scheduler_stats is not None:
            t.num_running = scheduler_stats.num_running_reqs
            t.num_waiting = scheduler_stats.num_waiting_reqs
            t.kv_cache_usage = scheduler_stats.kv_cache_usage
            t.preemptions += scheduler_stats.num_preemptions
            t.prefix_cache_queries += scheduler_stats.prefix_cache_queries
            t.prefix_cache_hits += scheduler_stats.prefix_cache_hits
            self._window_queries += scheduler_stats.prefix_cache_queries
            self._window_hits += scheduler_stats.prefix_cache_hits
            if scheduler_stats.spec_num_drafts:
                t.spec_num_drafts += scheduler_stats.spec_num_drafts
                t.spec_num_draft_tokens += scheduler_stats.spec_num_draft_tokens
                t.spec_num_accepted_tokens += scheduler_stats.spec_num_accepted_tokens
                window = self._window_spec
                window[0] += scheduler_stats.spec_num_drafts
                window[1] += scheduler_stats.spec_num_draft_tokens
                window[2] += scheduler_stats.spec_num_accepted_tokens
            if scheduler_stats.kv_connector_stats:
                _add(t.kv_connector, scheduler_stats.kv_connector_stats)
                _add(self._window_connector, scheduler_stats.kv_connector_stats)
        if iteration_stats is not None:
            t.prompt_tokens += iteration_stats.num_prompt_tokens
            t.generation_tokens += iteration_stats.num_generation_tokens
            self._window_prompt += iteration_stats.num_prompt_tokens
            self._window_generation += iteration_stats.num_generation_tokens
            for finished in iteration_stats.finished_requests:
                reason = str(finished.finish_reason)
                t.finished_by_reason[reason] = t.finished_by_reason.get(reason, 0) + 1
        for listener in self._listeners:
            try:
                listener(scheduler_stats, iteration_stats, engine_index)
            except Exception:  # metrics must never take the engine's output loop down
                logger.exception("stats listener %r failed", listener)
        self.maybe_log(now)

    def reset_gauges(self) -> None:
        """Zero what describes the engine's present (running, waiting, KV usage): called when
        the engine is gone, so the last values it reported do not linger."""
        for t in self.engines:
            t.num_running = t.num_waiting = 0
            t.kv_cache_usage = 0.0

    def maybe_log(self, now: float | None = None) -> str | None:
        """Log (and return) the line if ``interval`` has passed and the engine did something."""
        now = time.monotonic() if now is None else now
        elapsed = now - self._window_start
        if self.interval <= 0 or elapsed < self.interval:
            return None
        t = self.totals
        busy = self._window_prompt or self._window_generation or t.num_running or t.num_waiting
        line = None
        if busy:
            hit_rate = self._window_hits / self._window_queries if self._window_queries else 0.0
            line = (
                f"Engine: prompt {self._window_prompt / elapsed:.1f} tok/s, generation "
                f"{self._window_generation / elapsed:.1f} tok/s | running {t.num_running}, "
                f"waiting {t.num_waiting} | KV cache {t.kv_cache_usage:.1%} | prefix cache hit "
                f"rate {hit_rate:.1%} | preemptions {t.preemptions}"
            )
            if self._window_spec[0]:
                acceptance, mean_length = spec_decode_rates(*self._window_spec)
                line += (
                    f" | spec decode: acceptance rate {acceptance:.1%}, mean accepted length "
                    f"{mean_length:.2f}"
                )
            connector = self._window_connector
            if connector:
                line += (
                    f" | KV connector: {connector.get('hit_tokens', 0):.0f} tokens supplied, "
                    f"{connector.get('loaded_blocks', 0):.0f} blocks loaded, "
                    f"{connector.get('saved_blocks', 0):.0f} saved"
                )
            logger.info(line)
        self._window_connector = {}
        self._window_start = now
        self._window_prompt = self._window_generation = 0
        self._window_queries = self._window_hits = 0
        self._window_spec = [0, 0, 0]
        return line
