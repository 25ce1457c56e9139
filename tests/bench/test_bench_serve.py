"""``kiln bench serve`` without a server: settings, request bodies, and how one streamed response
becomes a ``RequestResult`` (SSE framing, usage, error events), on canned HTTP responses.

The run against a real ``kiln serve`` is in ``test_bench_serve_live.py``.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import httpx
import pytest

from kiln.bench.serve import BenchConfig, request_body, send_request


def sse(*events: object) -> bytes:
    parts = [e if isinstance(e, str) else f"data: {json.dumps(e)}\n\n" for e in events]
    return "".join(parts).encode()


def completion_chunk(text: str) -> dict:
    return {"id": "cmpl-1", "choices": [{"index": 0, "text": text, "finish_reason": None}]}


def chat_chunk(delta: dict) -> dict:
    return {"id": "chatcmpl-1", "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


def measure(body: bytes, status: int = 200, endpoint: str = "/v1/completions"):
    cfg = BenchConfig(endpoint=endpoint)

    async def go():
        transport = httpx.MockTransport(lambda request: httpx.Response(status, content=body))
        async with httpx.AsyncClient(transport=transport) as client:
            return await send_request(client, cfg, {"model": "m"}, prompt_len=7)

    return asyncio.run(go())


def test_tokens_come_from_usage_and_gaps_from_chunks():
    result = measure(
        sse(
            ": keep-alive comment\n\n",
            completion_chunk("Hello"),
            completion_chunk(" wor"),
            completion_chunk("ld"),
            {"id": "cmpl-1", "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}},
            "data: [DONE]\n\n",
        )
    )
    assert result.success, result.error
    assert (result.prompt_len, result.output_len) == (9, 4)
    assert len(result.itl) == 2  # three chunks with text: two gaps
    assert 0 < result.ttft <= result.latency


def test_without_usage_each_text_chunk_counts_as_a_token():
    result = measure(sse(completion_chunk("a"), completion_chunk(""), completion_chunk("b"),
                         "data: [DONE]\n\n"))  # fmt: skip
    assert result.success
    assert (result.prompt_len, result.output_len) == (7, 2)


def test_chat_role_only_delta_is_not_the_first_token():
    result = measure(
        sse(
            chat_chunk({"role": "assistant", "content": ""}),
            chat_chunk({"content": "Hi"}),
            chat_chunk({"content": "!"}),
            "data: [DONE]\n\n",
        ),  # fmt: skip
        endpoint="/v1/chat/completions",
    )
    assert result.success and result.output_len == 2 and len(result.itl) == 1


@pytest.mark.parametrize(
    "body, status, error",
    [
        (b'{"error": {"message": "bad", "code": 400}}', 400, "HTTP 400: "),
        (
            sse(completion_chunk("a"), {"error": {"message": "engine died"}}, "data: [DONE]\n\n"),
            200,
            "error event: ",
        ),  # fmt: skip
        (sse(completion_chunk("a")), 200, "stream ended without data: [DONE]"),
        (sse("data: [DONE]\n\n"), 200, "no output text was streamed"),
    ],
)
def test_failures_are_results_not_exceptions(body, status, error):
    result = measure(body, status)
    assert not result.success
    assert result.error.startswith(error)


def test_request_bodies_follow_vllm_bench():
    completions = request_body(BenchConfig(), "m", "p", 5)
    assert completions["prompt"] == "p" and completions["max_tokens"] == 5
    assert completions["ignore_eos"] is True and completions["stream"] is True
    assert completions["stream_options"] == {"include_usage": True}
    assert completions["temperature"] == 0.0
    chat = request_body(BenchConfig(endpoint="/v1/chat/completions"), "m", "p", 5)
    assert chat["messages"] == [{"role": "user", "content": "p"}]
    assert chat["max_completion_tokens"] == 5


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="base_url"):
        BenchConfig(base_url="ftp://x")
    with pytest.raises(ValueError, match="max_concurrency"):
        BenchConfig(max_concurrency=0)
    with pytest.raises(ValueError, match="num_prompts"):
        BenchConfig(num_prompts=0)
    with pytest.raises(ValueError, match="endpoint"):
        BenchConfig(endpoint="/v1/embeddings")
    assert BenchConfig(base_url="http://h:1/v1/").root == "http://h:1"


def test_no_server_fails_fast_with_a_message():
    with socket_port() as port:
        done = subprocess.run(
            [sys.executable, "-m", "kiln.entrypoints.cli", "bench", "serve",
             "--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "1"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert done.returncode == 1
    assert "no server at http://127.0.0.1:" in done.stderr


def socket_port():
    """A loopback port that is bound (so nobody else takes it) but not listening."""
    import contextlib
    import socket

    @contextlib.contextmanager
    def bound():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            yield s.getsockname()[1]

    return bound()
