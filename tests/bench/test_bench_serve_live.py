"""``kiln bench serve`` and ``kiln chat --url`` against a real ``kiln serve`` on the default model.

One server for the module (a small KV cache, on a port it picks itself: a port found free here and
handed to it would be free for anyone to take during its start-up, which takes minutes on a loaded
machine); each test runs the command line as a user would, in a subprocess, and a failure shows
the command's output and the server's state and log.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

KILN = os.path.join(os.path.dirname(sys.executable), "kiln")
START_TIMEOUT_S = 300
BANNER_URL = re.compile(r"^  URL +(http://\S+)", re.MULTILINE)
"""The start-up banner's URL line, printed once the port is bound and the engine is ready."""


@dataclass
class Server:
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def report(self, done: subprocess.CompletedProcess[str]) -> str:
        """A failure message: the command's exit status and output, then whether the server
        still runs and the end of its log."""
        status = self.process.poll()
        state = "running" if status is None else f"exited with {status}"
        log = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-40:])
        return (
            f"exit status {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}\n"
            f"kiln serve ({state}), the end of its log:\n{log}"
        )


@pytest.fixture(scope="module")
def server(gguf_path: str, tmp_path_factory: pytest.TempPathFactory):
    log_path = tmp_path_factory.mktemp("kiln-serve") / "server.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [
                KILN,
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
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
        url = None
        while True:
            if process.poll() is not None:
                pytest.fail(f"kiln serve exited with {process.returncode}:\n{log_path.read_text()}")
            if url is None and (found := BANNER_URL.search(log_path.read_text(errors="replace"))):
                url = found.group(1)
            if url is not None:
                try:
                    with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                        if response.status == 200:
                            break
                except OSError:
                    pass
            if time.monotonic() > deadline:
                pytest.fail(f"kiln serve not ready in {START_TIMEOUT_S} s:\n{log_path.read_text()}")
            time.sleep(0.5)
        yield Server(url, process, log_path)
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
def test_bench_serve_against_kiln_serve(server, endpoint):
    done = run_kiln(
        "bench", "serve", "--base-url", server.url, "--endpoint", endpoint,
        "--num-prompts", "4", "--input-len", "32", "--output-len", "8",
        "--max-concurrency", "2", "--json",
    )  # fmt: skip
    assert done.returncode == 0, server.report(done)
    result = json.loads(done.stdout)
    counts = (result["completed"], result["failed"], result["errors"])
    assert counts == (4, 0, []), server.report(done)
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


def test_bench_serve_text_report_and_progress_bar(server):
    done = run_kiln(
        "bench", "serve", "--base-url", server.url + "/v1", "--num-prompts", "2",
        "--input-len", "16", "--output-len", "4", "--max-concurrency", "1",
    )  # fmt: skip
    assert done.returncode == 0, server.report(done)
    assert "Successful requests:" in done.stdout and "Mean TPOT (ms):" in done.stdout
    assert "2/2" in done.stderr, server.report(done)  # tqdm's final count


def test_bench_serve_counts_failed_requests(server):
    # A model the server does not have: the warm-up fails and the run stops with a clear message.
    done = run_kiln(
        "bench", "serve", "--base-url", server.url, "--model", "no-such-model",
        "--num-prompts", "2", "--input-len", "8", "--output-len", "2",
    )  # fmt: skip
    assert done.returncode == 1, server.report(done)
    assert "warm-up request failed: HTTP 404" in done.stderr, server.report(done)


def test_chat_url_with_piped_stdin(server):
    done = run_kiln(
        "chat", "--url", server.url, "--temperature", "0", "--max-tokens", "12",
        stdin="What is the capital of France?\n/reset\nWhat is the capital of France?\n/exit\n",
    )  # fmt: skip
    assert done.returncode == 0, server.report(done)
    # A failed turn (the server answered an error, the connection broke) is reported on stderr
    # and the chat goes on: exit status 0, an empty line where the reply would be.
    first, reset, again = (done.stdout.splitlines() + ["", "", ""])[:3]
    assert "Paris" in first, server.report(done)
    assert reset == "(conversation reset)", server.report(done)
    # greedy, same conversation after the reset: the same reply
    assert again == first, server.report(done)


def test_chat_quick_message(server):
    done = run_kiln(
        "chat", "--url", server.url, "--temperature", "0", "--max-tokens", "12",
        "-q", "What is the capital of France?",
    )  # fmt: skip
    assert done.returncode == 0, server.report(done)
    assert "Paris" in done.stdout, server.report(done)
