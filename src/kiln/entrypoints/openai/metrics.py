"""``GET /metrics``: Prometheus metrics with vLLM's names, labels and buckets.

Every name is ``PREFIX:name`` with ``PREFIX`` from ``--metrics-prefix``: ``vllm`` (the default,
so that vLLM's Grafana dashboards and alerts work unchanged) or ``kiln`` (Kiln's names before).
One prefix at a time, not both: each series is stored once and a query over both cannot count
twice. Every series has the labels ``model_name`` (the served name) and ``engine`` (the engine
core's index, "0" to ``data_parallel_size - 1``: one series per engine), as vLLM's.

Gauges and counters are read from the engine's ``StatsTotals`` at scrape time (so they cannot
drift from what the engine logs); histograms are fed by a ``StatsRecorder`` listener, one
observation per first token, per inter-token gap, per engine step and per finished request.

Exported (``vllm:`` shown):

- gauges ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
  ``vllm:kv_cache_usage_perc`` (0..1) and its older name ``vllm:gpu_cache_usage_perc``, and
  ``vllm:num_requests_swapped`` / ``vllm:cpu_cache_usage_perc`` (vLLM's older dashboards query
  them; Kiln never swaps to CPU, so they stay 0);
- counters ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``,
  ``vllm:num_preemptions_total``, ``vllm:prefix_cache_queries_total``,
  ``vllm:prefix_cache_hits_total``, ``vllm:request_success_total{finished_reason}``,
  ``vllm:spec_decode_num_drafts_total``, ``vllm:spec_decode_num_draft_tokens_total``,
  ``vllm:spec_decode_num_accepted_tokens_total``, ``vllm:external_prefix_cache_hits_total`` (tokens
  a KV connector supplied) and the connector's ``vllm:kv_connector_<name>_total`` (blocks and
  bytes loaded and saved, seconds spent, failed loads: ``CONNECTOR_COUNTERS``), with the gauges
  ``vllm:spec_decode_acceptance_rate`` and ``vllm:spec_decode_mean_accepted_length`` made from them;
- histograms of time: ``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``
  and its older name ``vllm:time_per_output_token_seconds`` (the same gaps),
  ``vllm:e2e_request_latency_seconds``, and a finished request's phases
  ``vllm:request_queue_time_seconds`` (arrival to first scheduled),
  ``vllm:request_prefill_time_seconds`` (to the first token), ``vllm:request_decode_time_seconds``
  (first to last token) and ``vllm:request_inference_time_seconds`` (prefill + decode);
- histograms of counts: ``vllm:request_prompt_tokens``, ``vllm:request_generation_tokens``,
  ``vllm:request_max_num_generation_tokens`` (per client request, the longest of its ``n``
  completions), ``vllm:request_params_n``, ``vllm:request_params_max_tokens`` and
  ``vllm:iteration_tokens_total`` (prompt + generation tokens per engine step).
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
from kiln.entrypoints.openai.cli_args import METRICS_PREFIXES
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
LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
"""End-to-end latency and each phase of a request."""
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)

PER_FINISHED_REQUEST = (
    # (name, the ``FinishedRequestStats`` field observed, doc); ``*_seconds`` get
    # ``LATENCY_BUCKETS``, the others token-count buckets.
    ("e2e_request_latency_seconds", "e2e_latency", "Arrival to finish of a request."),
    ("request_queue_time_seconds", "queued_time", "Arrival to first scheduled (waiting)."),
    ("request_prefill_time_seconds", "prefill_time", "First scheduled to first token."),
    ("request_decode_time_seconds", "decode_time", "First to last token."),
    ("request_inference_time_seconds", "inference_time", "First scheduled to last token."),
    ("request_prompt_tokens", "num_prompt_tokens", "Prompt tokens of requests."),
    ("request_generation_tokens", "num_generation_tokens", "Generation tokens of requests."),
    ("request_params_max_tokens", "max_tokens_param", "The max_tokens of finished requests."),
)
"""Histograms with one observation per finished engine-core request."""

FINISH_REASONS = ("stop", "length", "abort")
"""Always exported (at 0 until a request finishes so), so dashboards see every series."""


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets, to the context
    length)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


CONNECTOR_COUNTERS = {
    "loaded_blocks": "blocks loaded into the KV cache.",
    "saved_blocks": "blocks saved from the KV cache.",
    "loaded_bytes": "bytes loaded into the KV cache.",
    "saved_bytes": "bytes saved from the KV cache.",
    "spilled_blocks": "blocks written on from a connector's memory tier to its disk tier.",
    "spilled_bytes": "bytes written on from a connector's memory tier to its disk tier.",
    "load_seconds": "seconds spent loading.",
    "save_seconds": "seconds spent saving.",
    "failed_loads": "loads that failed (their blocks recomputed or their requests failed).",
}
"""The KV connector's counters (``kiln.kv_transfer.STAT_NAMES`` but ``hit_tokens``)."""


class _TotalsCollector(Collector):
    """Gauges and counters straight from each engine's ``StatsTotals``."""

    def __init__(self, stats: StatsRecorder, model_name: str, prefix: str) -> None:
        self.stats = stats
        self.model_name = model_name
        self.prefix = prefix
        self.names = ["model_name", "engine"]
        self.values: list[str] = []
        """The labels of the engine being collected."""
        self.families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}

    def _gauge(self, name: str, doc: str, value: float) -> None:
        self._add(GaugeMetricFamily, name, doc, value)

    def _counter(self, name: str, doc: str, value: float) -> None:
        self._add(CounterMetricFamily, name, doc, value)

    def _add(
        self,
        kind: type[CounterMetricFamily] | type[GaugeMetricFamily],
        name: str,
        doc: str,
        value: float,
    ) -> None:
        """The current engine's sample of family ``name`` (made at the first engine)."""
        if name not in self.families:
            self.families[name] = kind(f"{self.prefix}:{name}", doc, labels=self.names)
        self.families[name].add_metric(self.values, value)

    def collect(self) -> Iterator[Metric]:
        self.families = {}
        for index, totals in enumerate(self.stats.engines):
            self.values = [self.model_name, str(index)]
            self._collect_engine(totals)
        yield from self.families.values()

    def _collect_engine(self, t: StatsTotals) -> None:
        self._gauge("num_requests_running", "Requests in the running batch.", t.num_running)
        self._gauge("num_requests_waiting", "Requests waiting to run.", t.num_waiting)
        self._gauge("kv_cache_usage_perc", "KV-cache usage (0..1).", t.kv_cache_usage)
        self._gauge(
            "gpu_cache_usage_perc",
            "KV-cache usage (0..1). Deprecated (vLLM's older name): use kv_cache_usage_perc.",
            t.kv_cache_usage,
        )
        self._gauge("num_requests_swapped", "Requests swapped to CPU: never (0).", 0)
        self._gauge("cpu_cache_usage_perc", "CPU swap-cache usage: none (0).", 0.0)
        self._counter("prompt_tokens", "Prompt tokens processed.", t.prompt_tokens)
        self._counter("generation_tokens", "Generation tokens produced.", t.generation_tokens)
        self._counter("num_preemptions", "Preemptions (KV cache full).", t.preemptions)
        self._counter(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            t.prefix_cache_queries,
        )
        self._counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache.", t.prefix_cache_hits
        )
        self._counter(
            "spec_decode_num_drafts",
            "Speculative decoding: request-steps that verified drafts.",
            t.spec_num_drafts,
        )
        self._counter(
            "spec_decode_num_draft_tokens",
            "Speculative decoding: draft tokens verified.",
            t.spec_num_draft_tokens,
        )
        self._counter(
            "spec_decode_num_accepted_tokens",
            "Speculative decoding: draft tokens accepted.",
            t.spec_num_accepted_tokens,
        )
        self._counter(
            "external_prefix_cache_hits",
            "Prompt tokens a KV connector supplied (past the local prefix cache).",
            t.kv_connector.get("hit_tokens", 0),
        )
        for name, doc in CONNECTOR_COUNTERS.items():
            self._counter(
                f"kv_connector_{name}", f"KV connector: {doc}", t.kv_connector.get(name, 0)
            )
        acceptance, mean_length = spec_decode_rates(
            t.spec_num_drafts, t.spec_num_draft_tokens, t.spec_num_accepted_tokens
        )
        self._gauge(
            "spec_decode_acceptance_rate",
            "Speculative decoding: accepted / verified draft tokens since start (0..1).",
            acceptance,
        )
        self._gauge(
            "spec_decode_mean_accepted_length",
            "Speculative decoding: tokens per verifying step since start (accepted drafts + 1).",
            mean_length,
        )
        if "request_success" not in self.families:
            self.families["request_success"] = CounterMetricFamily(
                f"{self.prefix}:request_success",
                "Finished requests, by finish reason.",
                labels=[*self.names, "finished_reason"],
            )
        success = self.families["request_success"]
        counts = {reason: 0 for reason in FINISH_REASONS} | t.finished_by_reason
        for reason, count in sorted(counts.items()):
            success.add_metric([*self.values, reason], count)


class ServerMetrics:
    """The ``/metrics`` registry of one server.

    Args:
        stats: the engine's ``StatsRecorder`` (this registers a listener on it).
        model_name: the ``model_name`` label.
        max_model_len: the context length: the last bucket of the token-count histograms.
        prefix: the names' prefix, one of ``METRICS_PREFIXES``.

    Raises:
        ValueError: ``prefix`` is not one of ``METRICS_PREFIXES``.
    """

    def __init__(
        self, stats: StatsRecorder, model_name: str, max_model_len: int, prefix: str = "vllm"
    ) -> None:
        if prefix not in METRICS_PREFIXES:
            raise ValueError(f"metrics prefix must be one of {METRICS_PREFIXES}, got {prefix!r}")
        disable_created_metrics()  # no ``*_created`` series (as vLLM)
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_TotalsCollector(stats, model_name, prefix))
        self.model_name = model_name
        self.num_engines = len(stats.engines)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            family = Histogram(
                f"{prefix}:{name}",
                doc,
                ["model_name", "engine"],
                buckets=buckets,
                registry=self.registry,
            )
            for index in range(self.num_engines):  # every engine's series, from the start
                family.labels(model_name, str(index))
            return family

        tokens = buckets_1_2_5(max_model_len)
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram(
            "inter_token_latency_seconds", "Time between output tokens.", ITL_BUCKETS
        )
        self.tpot = histogram(
            "time_per_output_token_seconds",
            "Time between output tokens (vLLM's older name of inter_token_latency_seconds).",
            ITL_BUCKETS,
        )
        self.per_finished = [
            (field, histogram(name, doc, LATENCY_BUCKETS if name.endswith("_seconds") else tokens))
            for name, field, doc in PER_FINISHED_REQUEST
        ]
        self.max_generation_tokens = histogram(
            "request_max_num_generation_tokens",
            "Per finished request, the most tokens one of its n completions generated.",
            tokens,
        )
        self.params_n = histogram("request_params_n", "The n of finished requests.", N_BUCKETS)
        self.iteration_tokens = histogram(
            "iteration_tokens_total",
            "Prompt and generation tokens per engine step.",
            ITERATION_TOKEN_BUCKETS,
        )
        self._step_tokens = [0] * self.num_engines
        """Tokens of each engine's step so far, until its scheduler stats close the step."""
        stats.add_listener(self.observe)

    def observe(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration: IterationStats | None,
        engine_index: int,
    ) -> None:
        labels = (self.model_name, str(engine_index))
        if iteration is not None:
            tokens = iteration.num_prompt_tokens + iteration.num_generation_tokens
            self._step_tokens[engine_index] += tokens
        # A step's outputs may come in several records; its scheduler stats come with the last.
        # Steps without a token (an idle engine's report, a prefill chunk) are not observed.
        if scheduler_stats is not None and self._step_tokens[engine_index]:
            self.iteration_tokens.labels(*labels).observe(self._step_tokens[engine_index])
            self._step_tokens[engine_index] = 0
        if iteration is None:
            return
        for value in iteration.time_to_first_tokens:
            self.ttft.labels(*labels).observe(value)
        for value in iteration.inter_token_latencies:
            self.itl.labels(*labels).observe(value)
            self.tpot.labels(*labels).observe(value)
        for finished in iteration.finished_requests:
            for field, family in self.per_finished:
                value = getattr(finished, field)
                if value is not None:  # max_tokens_param: None when the request set none
                    family.labels(*labels).observe(value)
        for value in iteration.max_num_generation_tokens:
            self.max_generation_tokens.labels(*labels).observe(value)
        for value in iteration.n_params:
            self.params_n.labels(*labels).observe(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)


__all__ = ["CONTENT_TYPE", "ServerMetrics"]
