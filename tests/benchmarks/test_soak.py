"""``benchmarks/soak.py`` end to end, small: it starts its own ``kiln serve`` (default model),
sends a handful of mixed requests with deliberate disconnects, and must report them all, memory
samples of both processes, an idle engine with an empty KV cache at the end, and no error.

A smoke test so that the script cannot rot: the soak itself (thousands of requests) is run by
hand, see the script's docstring.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

SOAK = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "soak.py")
NUM_REQUESTS = 24


def _soak(*args: str, timeout: float = 420) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, SOAK, *args], capture_output=True, text=True, timeout=timeout
    )


def test_soak_smoke(gguf_path: str) -> None:
    done = _soak(
        "--num-requests",
        str(NUM_REQUESTS),
        "--concurrency",
        "4",
        "--max-tokens",
        "4",
        "--disconnect-rate",
        "0.3",
        "--sample-interval",
        "0.2",
        "--server-arg=--dtype=float32",
        "--json",
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["passed"] is True
    assert report["requests_sent"] == NUM_REQUESTS
    assert report["ok"] + report["abandoned"] == NUM_REQUESTS
    assert report["abandoned"] > 0, "no request was abandoned: the disconnect path did not run"
    assert report["ok"] > 0
    assert report["errors"] == {}
    # Both kinds of request, streamed and not, made it into the mix.
    assert set(report["mix"]) == {"chat", "chat stream", "completions", "completions stream"}
    assert report["kv_usage_end"] == 0 and report["running_end"] == 0
    assert report["kv_usage_max"] > 0, "the KV cache was never seen in use"
    for key in ("api_rss_mib", "engine_rss_mib"):
        memory = report[key]
        assert memory is not None, f"{key} was not sampled"
        # A 135M model in float32 alone is over 500 MB; an API server is over 50 MB.
        assert memory["peak"] > 50
    assert report["engine_rss_mib"]["peak"] > 500
    assert report["health_end"] == 200
    assert report["server_exit_code"] == 0


def test_soak_refuses_a_remote_url() -> None:
    done = _soak("--base-url", "http://192.0.2.1:8000", "--num-requests", "1", timeout=60)
    assert done.returncode == 2
    assert "loopback" in done.stderr
