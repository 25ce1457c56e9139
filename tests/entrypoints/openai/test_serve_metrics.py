"""``/metrics`` under vLLM's names, as a user of vLLM's dashboards sees it: requests sent with the
official ``openai`` client to a real ``kiln serve``, then the scrape; and the Grafana dashboard
shipped in ``examples/grafana`` queries only names the server exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import openai
import pytest

from kiln.engine.stats import StatsRecorder
from kiln.entrypoints.cli import build_parser
from kiln.entrypoints.openai.metrics import ServerMetrics
from kiln.testing.server import MAX_MODEL_LEN, KilnServer, metric, scrape

DASHBOARD = Path(__file__).parents[3] / "examples" / "grafana" / "kiln-vllm-dashboard.json"
_NAME = re.compile(r"\bvllm:[a-zA-Z0-9_:]+")


def exported_names(samples: dict[str, float]) -> set[str]:
    return {key.partition("{")[0] for key in samples}


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            queries.append(variable["query"]["query"])
    return queries


def test_requests_fill_vllms_histograms(
    client: openai.OpenAI, http: httpx.Client, model_name: str
) -> None:
    """Two completions (3 tokens) and a chat with n=2 (2 tokens each): four engine requests, three
    client requests, each counted once in every histogram vLLM's dashboards read."""
    before = scrape(http)
    for prompt in ("The sky is", "One two three"):
        client.completions.create(
            model=model_name, prompt=prompt, max_tokens=3, extra_body={"ignore_eos": True}
        )
    client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Hi"}],
        n=2,
        max_tokens=2,
        extra_body={"ignore_eos": True},
    )
    after = scrape(http)
    labels = {"model_name": model_name, "engine": "0"}

    def delta(name: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    phases = ("queue_time", "prefill_time", "decode_time", "inference_time")
    for name in ["e2e_request_latency", *(f"request_{phase}" for phase in phases)]:
        assert delta(f"vllm:{name}_seconds_count") == 4, name
    assert delta("vllm:generation_tokens_total") == 3 + 3 + 2 + 2
    assert delta("vllm:request_generation_tokens_sum") == 10
    assert delta("vllm:request_params_max_tokens_sum") == 10
    # Per client request: its longest completion and its n.
    assert delta("vllm:request_max_num_generation_tokens_count") == 3
    assert delta("vllm:request_max_num_generation_tokens_sum") == 3 + 3 + 2
    assert (delta("vllm:request_params_n_count"), delta("vllm:request_params_n_sum")) == (3, 4)
    # The token gaps, under both of vLLM's names.
    gaps = 2 + 2 + 1 + 1
    assert delta("vllm:inter_token_latency_seconds_count") == gaps
    assert delta("vllm:time_per_output_token_seconds_count") == gaps
    # Every token of every engine step, once.
    tokens = delta("vllm:prompt_tokens_total") + delta("vllm:generation_tokens_total")
    assert delta("vllm:iteration_tokens_total_sum") == tokens
    assert delta("vllm:iteration_tokens_total_count") >= 3  # a prefill and a decode at least
    # Sensible times: work took time, phases add up, and none exceeds the whole.
    prefill = delta("vllm:request_prefill_time_seconds_sum")
    decode = delta("vllm:request_decode_time_seconds_sum")
    inference = delta("vllm:request_inference_time_seconds_sum")
    queue = delta("vllm:request_queue_time_seconds_sum")
    e2e = delta("vllm:e2e_request_latency_seconds_sum")
    assert prefill > 0 and decode > 0 and queue >= 0
    assert inference == pytest.approx(prefill + decode, rel=1e-6, abs=1e-6)
    assert queue + inference <= e2e + 1e-3
    assert delta("vllm:time_to_first_token_seconds_sum") >= prefill
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        assert metric(after, name, **labels) == 0
    assert metric(after, "vllm:gpu_cache_usage_perc", **labels) == metric(
        after, "vllm:kv_cache_usage_perc", **labels
    )


def test_labels_and_buckets_are_vllms(http: httpx.Client, model_name: str) -> None:
    samples = scrape(http)
    assert samples and all(key.startswith("vllm:") for key in samples)
    for key in samples:
        assert f'model_name="{model_name}"' in key and 'engine="0"' in key, key
    # Token counts in 1-2-5 buckets up to the context length, latencies in vLLM's.
    prompt_buckets = [k for k in samples if k.startswith("vllm:request_prompt_tokens_bucket")]
    assert any('le="1000.0"' in k for k in prompt_buckets)
    assert not any('le="2000.0"' in k for k in prompt_buckets) and MAX_MODEL_LEN < 2000
    assert any('le="7680.0"' in k for k in samples if "request_queue_time_seconds_bucket" in k)
    assert metric(samples, "vllm:request_success_total", finished_reason="abort") >= 0


def test_head_metrics_is_200(server: KilnServer) -> None:
    response = httpx.head(f"{server.url}/metrics")
    assert response.status_code == 200
    assert response.content == b""


def test_dashboard_queries_name_exported_metrics(http: httpx.Client) -> None:
    exported = exported_names(scrape(http))
    queries = dashboard_queries()
    assert len(queries) >= 15
    for query in queries:
        names = _NAME.findall(query)
        assert names, f"no vllm: metric in {query!r}"
        missing = [name for name in names if name not in exported]
        assert not missing, f"{query!r} names {missing}, not exported"


def test_kiln_prefix_names_the_same_metrics() -> None:
    """``--metrics-prefix kiln``: the same series under ``kiln:``; other values are refused."""
    parser = build_parser()
    assert parser.parse_args(["serve"]).metrics_prefix == "vllm"
    assert parser.parse_args(["serve", "--metrics-prefix", "kiln"]).metrics_prefix == "kiln"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--metrics-prefix", "prom"])
    with pytest.raises(ValueError, match="'prom'"):
        ServerMetrics(StatsRecorder(), "m", 1024, prefix="prom")

    def names(prefix: str) -> set[str]:
        text = ServerMetrics(StatsRecorder(), "m", 1024, prefix=prefix).render().decode()
        found = {line.split("{")[0] for line in text.splitlines() if not line.startswith("#")}
        assert all(name.startswith(f"{prefix}:") for name in found)
        return {name.partition(":")[2] for name in found}

    assert names("kiln") == names("vllm")
