"""Percentiles, TPOT and the run summary of ``kiln bench serve`` on hand-made timings."""

import numpy as np
import pytest

from kiln.bench.metrics import (
    RequestResult,
    calculate_metrics,
    format_metrics,
    mean,
    percentile,
)


@pytest.mark.parametrize(
    "values",
    [[1.0], [3.0, 1.0, 2.0], [0.5, 0.1, 0.9, 0.3], list(np.random.default_rng(0).random(101))],
)
@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 100])
def test_percentile_matches_numpy_linear(values, q):
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_by_hand():
    # Ranks 0..4; p99 sits at rank 3.96: 40 + 0.96 * (50 - 40).
    assert percentile([10, 20, 30, 40, 50], 50) == 30
    assert percentile([10, 20, 30, 40, 50], 99) == pytest.approx(49.6)
    assert percentile([1, 2], 50) == 1.5
    assert percentile([], 50) == 0.0


def test_percentile_rejects_out_of_range_q():
    with pytest.raises(ValueError, match="q must be in \\[0, 100\\]"):
        percentile([1.0], 101)


def test_tpot_excludes_the_first_token():
    # 0.5 s to the first token, then 4 more tokens in 2.0 s: 0.5 s per output token.
    result = RequestResult(success=True, output_len=5, ttft=0.5, latency=2.5)
    assert result.tpot == pytest.approx(0.5)
    assert RequestResult(success=True, output_len=1, ttft=0.5, latency=0.5).tpot is None
    assert RequestResult(success=False, output_len=5, ttft=0.5, latency=2.5).tpot is None


def test_calculate_metrics_by_hand():
    results = [
        RequestResult(True, 10, 5, ttft=0.1, latency=0.5, itl=[0.1, 0.1, 0.1, 0.1]),
        RequestResult(True, 20, 3, ttft=0.3, latency=0.7, itl=[0.2, 0.2]),
        RequestResult(False, 10, 0, error="HTTP 500: boom"),
    ]
    m = calculate_metrics(results, duration=2.0)
    assert (m.completed, m.failed) == (2, 1)
    assert (m.total_input_tokens, m.total_output_tokens) == (30, 8)
    assert m.request_throughput == pytest.approx(1.0)
    assert m.output_throughput == pytest.approx(4.0)
    assert m.total_token_throughput == pytest.approx(19.0)
    assert m.mean_ttft_ms == pytest.approx(200.0)
    assert m.median_ttft_ms == pytest.approx(200.0)
    assert m.p99_ttft_ms == pytest.approx(298.0)
    # TPOT: (0.5 - 0.1) / 4 = 0.1 and (0.7 - 0.3) / 2 = 0.2.
    assert m.mean_tpot_ms == pytest.approx(150.0)
    assert m.p99_tpot_ms == pytest.approx(199.0)
    # ITL pools the gaps of every request: four of 0.1 and two of 0.2.
    assert m.mean_itl_ms == pytest.approx(1000 * 0.8 / 6)
    assert m.median_itl_ms == pytest.approx(100.0)
    assert m.mean_e2el_ms == pytest.approx(600.0)


def test_calculate_metrics_all_failed_is_zeroes_not_an_error():
    m = calculate_metrics([RequestResult(error="x")] * 3, duration=1.0)
    assert (m.completed, m.failed, m.output_throughput, m.mean_ttft_ms) == (0, 3, 0.0, 0.0)


def test_calculate_metrics_rejects_zero_duration():
    with pytest.raises(ValueError, match="duration must be > 0"):
        calculate_metrics([], duration=0.0)


def test_format_metrics_lists_every_statistic():
    m = calculate_metrics([RequestResult(True, 4, 3, 0.1, 0.3, [0.1, 0.1])], duration=1.0)
    text = format_metrics(m)
    for label in (
        "Successful requests:",
        "Output token throughput",
        "Mean TTFT (ms):",
        "Median TPOT (ms):",
        "P99 ITL (ms):",
        "P99 E2EL (ms):",
    ):
        assert label in text
    assert mean([]) == 0.0
