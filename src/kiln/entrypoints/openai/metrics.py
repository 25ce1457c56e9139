"""``GET /metrics``: Prometheus metrics with vLLM's names under ``kiln:``.

Gauges and counters are read from the engine's ``StatsTotals`` at scrape time (so they cannot
drift from what the engine logs); histograms are fed by a ``StatsRecorder`` listener, one
observation per first token, per inter-token gap and per finished request. Every series has the
labels ``model_name`` (the served name) and ``engine`` (the engine core's index, "0" to
``data_parallel_size - 1``: one series per engine), as vLLM's.

Exported: ``kiln:num_requests_running``, ``kiln:num_requests_waiting``,
``kiln:kv_cache_usage_perc`` (0..1), ``kiln:prompt_tokens_total``, ``kiln:generation_tokens_total``,
``kiln:num_preemptions_total``, ``kiln:prefix_cache_queries_total``,
``kiln:prefix_cache_hits_total``, ``kiln:request_success_total{finished_reason}``,
``kiln:spec_decode_num_drafts_total``, ``kiln:spec_decode_num_draft_tokens_total``,
``kiln:spec_decode_num_accepted_tokens_total`` (vLLM's speculative-decoding counters) with the
gauges ``kiln:spec_decode_acceptance_rate`` and ``kiln:spec_decode_mean_accepted_length`` made
from them, and the
histograms ``kiln:time_to_first_token_seconds``, ``kiln:inter_token_latency_seconds``,
``kiln:e2e_request_latency_seconds``, ``kiln:request_prompt_tokens``,
``kiln:request_generation_tokens``.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import (
    CollectorRegistry,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kiln.engine.stats import IterationStats, StatsRecorder, StatsTotals, spec_decode_rates
from kiln.messages import SchedulerStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)

FINISH_REASONS = ("stop", "length", "abort")
"""Always exported (at 0 until a request finishes so), so dashboards see every series."""


class _TotalsCollector(Collector):
    """Gauges and counters straight from each engine's ``StatsTotals``."""

    def __init__(self, stats: StatsRecorder, model_name: str) -> None:
        self.stats = stats
        self.model_name = model_name
        self.names = ["model_name", "engine"]
        self.values: list[str] = []
        """The labels of the engine being collected."""
        self.families: dict[str, Metric] = {}

    def _gauge(self, name: str, doc: str, value: float) -> None:
        self._add(GaugeMetricFamily, name, doc, value)

    def _counter(self, name: str, doc: str, value: float) -> None:
        self._add(CounterMetricFamily, name, doc, value)

    def _add(self, kind: type, name: str, doc: str, value: float) -> None:
        """The current engine's sample of family ``name`` (made at the first engine)."""
        if name not in self.families:
            self.families[name] = kind(name, doc, labels=self.names)
        self.families[name].add_metric(self.values, value)

    def collect(self) -> Iterator[Metric]:
        self.families = {}
        for index, totals in enumerate(self.stats.engines):
            self.values = [self.model_name, str(index)]
            self._collect_engine(totals)
        yield from self.families.values()

    def _collect_engine(self, t: StatsTotals) -> None:
        self._gauge("kiln:num_requests_running", "Requests in the running batch.", t.num_running)
        self._gauge("kiln:num_requests_waiting", "Requests waiting to run.", t.num_waiting)
        self._gauge(
            "kiln:kv_cache_usage_perc",
            "Fraction of KV-cache blocks in use (0..1).",
            t.kv_cache_usage,
        )
        self._counter("kiln:prompt_tokens", "Prompt tokens processed.", t.prompt_tokens)
        self._counter("kiln:generation_tokens", "Generation tokens produced.", t.generation_tokens)
        self._counter("kiln:num_preemptions", "Preemptions (KV cache full).", t.preemptions)
        self._counter(
            "kiln:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            t.prefix_cache_queries,
        )
        self._counter(
            "kiln:prefix_cache_hits",
            "Prompt tokens found in the prefix cache.",
            t.prefix_cache_hits,
        )
        self._counter(
            "kiln:spec_decode_num_drafts",
            "Speculative decoding: request-steps that verified drafts.",
            t.spec_num_drafts,
        )
        self._counter(
            "kiln:spec_decode_num_draft_tokens",
            "Speculative decoding: draft tokens verified.",
            t.spec_num_draft_tokens,
        )
        self._counter(
            "kiln:spec_decode_num_accepted_tokens",
            "Speculative decoding: draft tokens accepted.",
            t.spec_num_accepted_tokens,
        )
        acceptance, mean_length = spec_decode_rates(
            t.spec_num_drafts, t.spec_num_draft_tokens, t.spec_num_accepted_tokens
        )
        self._gauge(
            "kiln:spec_decode_acceptance_rate",
            "Speculative decoding: accepted / verified draft tokens since start (0..1).",
            acceptance,
        )
        self._gauge(
            "kiln:spec_decode_mean_accepted_length",
            "Speculative decoding: tokens per verifying step since start (accepted drafts + 1).",
            mean_length,
        )
        if "kiln:request_success" not in self.families:
            self.families["kiln:request_success"] = CounterMetricFamily(
                "kiln:request_success",
                "Finished requests, by finish reason.",
                labels=[*self.names, "finished_reason"],
            )
        success = self.families["kiln:request_success"]
        counts = {reason: 0 for reason in FINISH_REASONS} | t.finished_by_reason
        for reason, count in sorted(counts.items()):
            success.add_metric([*self.values, reason], count)


class ServerMetrics:
    """The ``/metrics`` registry of one server.

    Args:
        stats: the engine's ``StatsRecorder`` (this registers a listener on it).
        model_name: the ``model_name`` label.
    """

    def __init__(self, stats: StatsRecorder, model_name: str) -> None:
        disable_created_metrics()  # no ``*_created`` series (as vLLM)
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_TotalsCollector(stats, model_name))
        self.model_name = model_name
        self.num_engines = len(stats.engines)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            family = Histogram(
                name, doc, ["model_name", "engine"], buckets=buckets, registry=self.registry
            )
            for index in range(self.num_engines):  # every engine's series, from the start
                family.labels(model_name, str(index))
            return family

        self.ttft = histogram(
            "kiln:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "kiln:inter_token_latency_seconds", "Time between output tokens.", ITL_BUCKETS
        )
        self.e2e = histogram(
            "kiln:e2e_request_latency_seconds", "Arrival to finish of a request.", E2E_BUCKETS
        )
        self.prompt_tokens = histogram(
            "kiln:request_prompt_tokens", "Prompt tokens of finished requests.", TOKEN_BUCKETS
        )
        self.generation_tokens = histogram(
            "kiln:request_generation_tokens",
            "Generation tokens of finished requests.",
            TOKEN_BUCKETS,
        )
        stats.add_listener(self.observe)

    def observe(
        self, _: SchedulerStats | None, iteration: IterationStats | None, engine_index: int
    ) -> None:
        if iteration is None:
            return
        labels = (self.model_name, str(engine_index))
        for value in iteration.time_to_first_tokens:
            self.ttft.labels(*labels).observe(value)
        for value in iteration.inter_token_latencies:
            self.itl.labels(*labels).observe(value)
        for finished in iteration.finished_requests:
            self.e2e.labels(*labels).observe(finished.e2e_latency)
            self.prompt_tokens.labels(*labels).observe(finished.num_prompt_tokens)
            self.generation_tokens.labels(*labels).observe(finished.num_generation_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)


__all__ = ["CONTENT_TYPE", "ServerMetrics"]
