"""``kiln bench serve`` and ``kiln chat --url`` against a real ``kiln serve`` on the default model.

One server for the module (a free loopback port, a small KV cache); each test runs the command
line as a user would, in a subprocess.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytestmark = pytest.mark.slow

KILN = os.path.join(os.path.dirname(sys.executable), "kiln")
START_TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server_url(gguf_path: str, tmp_path_factory: pytest.TempPathFactory):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path_factory.mktemp("kiln-serve") / "server.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [
                KILN,
                "serve",
                "--port",
                str(port),
                "--kv-cache-memory",
                "0.25",
                "--max-num-seqs",
                "8",
                "--disable-log-stats",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"kiln serve exited with {process.returncode}:\n{log_path.read_text()}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"kiln serve not ready in {START_TIMEOUT_S} s:\n{log_path.read_text()}")
            time.sleep(0.5)
        yield url
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def run_kiln(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([KILN, *args], input=stdin, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_bench_serve_against_kiln_serve(server_url, endpoint):
    done = run_kiln(
        "bench", "serve", "--base-url", server_url, "--endpoint", endpoint,
        "--num-prompts", "4", "--input-len", "32", "--output-len", "8",
        "--max-concurrency", "2", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert (result["completed"], result["failed"], result["errors"]) == (4, 0, [])
    assert result["endpoint"] == endpoint
    assert result["max_concurrency"] == 2
    # ignore_eos: every request generates exactly output_len tokens (as the server counts them).
    assert result["total_output_tokens"] == 4 * 8
    if endpoint == "/v1/completions":
        # The server has /tokenize, so each prompt was calibrated to exactly input_len tokens.
        assert result["prompt_lens_calibrated"]
        assert result["total_input_tokens"] == 4 * 32
    else:
        assert result["total_input_tokens"] > 4 * 32  # the chat template adds its own tokens
    for key in ("duration", "request_throughput", "output_throughput", "total_token_throughput",
                "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
                "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "mean_e2el_ms"):  # fmt: skip
        assert result[key] > 0, key
    assert result["p99_ttft_ms"] >= result["median_ttft_ms"]
    assert result["mean_e2el_ms"] > result["mean_ttft_ms"]
    # Throughput and duration agree: 32 tokens over the run's wall time.
    assert result["output_throughput"] == pytest.approx(32 / result["duration"])


def test_bench_serve_text_report_and_progress_bar(server_url):
    done = run_kiln(
        "bench", "serve", "--base-url", server_url + "/v1", "--num-prompts", "2",
        "--input-len", "16", "--output-len", "4", "--max-concurrency", "1",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "Successful requests:" in done.stdout and "Mean TPOT (ms):" in done.stdout
    assert "2/2" in done.stderr  # tqdm's final count


def test_bench_serve_counts_failed_requests(server_url):
    # A model the server does not have: the warm-up fails and the run stops with a clear message.
    done = run_kiln(
        "bench", "serve", "--base-url", server_url, "--model", "no-such-model",
        "--num-prompts", "2", "--input-len", "8", "--output-len", "2",
    )  # fmt: skip
    assert done.returncode == 1
    assert "warm-up request failed: HTTP 404" in done.stderr


def test_chat_url_with_piped_stdin(server_url):
    done = run_kiln(
        "chat", "--url", server_url, "--temperature", "0", "--max-tokens", "12",
        stdin="What is the capital of France?\n/reset\nWhat is the capital of France?\n/exit\n",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    first, reset, again = done.stdout.splitlines()[:3]
    assert "Paris" in first
    assert reset == "(conversation reset)"
    assert again == first  # greedy, same conversation after the reset: the same reply


def test_chat_quick_message(server_url):
    done = run_kiln(
        "chat", "--url", server_url, "--temperature", "0", "--max-tokens", "12",
        "-q", "What is the capital of France?",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout
