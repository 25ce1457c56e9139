"""``benchmarks/soak.py`` end to end, small: it starts its own ``kiln serve`` (default model),
sends a handful of mixed requests with deliberate disconnects, and must report them all, memory
samples of both processes, an idle engine with an empty KV cache at the end, and no error.

A smoke test so that the script cannot rot: the soak itself (thousands of requests) is run by
hand, see the script's docstring.
"""

from __future__ import annotations

import importlib.util
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


def _load_soak():
    spec = importlib.util.spec_from_file_location("soak", SOAK)
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("url", ["http://192.0.2.1:8000", "http://example.com"])
def test_soak_refuses_a_remote_url(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    # Arguments only: nothing is sent, even if the check breaks.
    soak = _load_soak()
    with pytest.raises(SystemExit) as exit_info:
        soak.parse_args(["--base-url", url])
    assert exit_info.value.code == 2
    assert "loopback" in capsys.readouterr().err
    assert soak.parse_args(["--base-url", "http://127.0.0.1:8000"]).base_url
