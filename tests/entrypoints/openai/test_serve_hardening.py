"""What a hostile or careless client sends, against the shared server: each request gets a 4xx
with an OpenAI error body (never a 500), and the server keeps serving. Covers request-supplied
chat templates, the API key on the tokenizer routes, oversized bodies and prompts, unbounded
``n``, responses of hundreds of MB asked for in a few kB, overflowing integers, lone surrogates,
bad content parts, template variables that collide, non-finite floats, nulls the OpenAI SDK sends,
reused request ids, the abort counter and the bound on remembered unknown field names."""

from __future__ import annotations

import json
import re
import threading
from typing import Any

import httpx
import pytest

from kiln.entrypoints.openai.serving_engine import MAX_WARNED_FIELDS
from kiln.testing.server import API_KEY, KilnServer, metric, parse_sse, scrape, wait_until_idle

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Hi"}]
TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"


def _error(response: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["message"]
    return error


def _raw(http: httpx.Client, route: str, body: str | bytes) -> httpx.Response:
    """POST a JSON body as given (JSON that ``json=`` would not write: NaN, huge numbers)."""
    return http.post(route, content=body, headers={"content-type": "application/json"})


def _chat(http: httpx.Client, **fields: Any) -> httpx.Response:
    return http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, **fields})


def _complete(http: httpx.Client, **fields: Any) -> httpx.Response:
    return http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, **fields})


def test_request_chat_templates_are_refused_without_the_flag(http: httpx.Client) -> None:
    assert _error(_chat(http, chat_template=TEMPLATE))["param"] == "chat_template"
    kwargs = {"chat_template": TEMPLATE}
    assert _error(_chat(http, chat_template_kwargs=kwargs))["param"] == "chat_template"
    body = {"messages": MESSAGES, "chat_template": TEMPLATE}
    assert _error(http.post("/tokenize", json=body))["param"] == "chat_template"
    assert _chat(http).status_code == 200


def test_tokenizer_routes_need_the_api_key(server: KilnServer, http: httpx.Client) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as anonymous:
        assert _error(anonymous.post("/tokenize", json={"prompt": "Hi"}), 401)
        assert _error(anonymous.post("/detokenize", json={"tokens": [1, 2]}), 401)
        assert anonymous.get("/health").status_code == 200
    assert http.post("/tokenize", json={"prompt": "Hi"}).json()["count"] >= 1
    assert http.post("/detokenize", json={"tokens": [1, 2]}).status_code == 200


def test_a_body_over_the_limit_is_413(http: httpx.Client) -> None:
    """The default limit is 16 MiB: a 20 MB prompt is refused before it is read or tokenized,
    whether its size is declared or it arrives chunked."""
    prompt = "word " * (4 * 2**20)
    body = json.dumps({"prompt": prompt, "max_tokens": 1}).encode()
    assert len(body) > 16 * 2**20
    declared = _raw(http, "/v1/completions", body)
    assert _error(declared, 413)["type"] == "RequestTooLargeError"
    chunks = (body[i : i + 2**20] for i in range(0, len(body), 2**20))
    headers = {"content-type": "application/json"}
    chunked = http.post("/v1/completions", content=chunks, headers=headers)
    assert _error(chunked, 413)
    assert _complete(http).status_code == 200


def test_a_prompt_too_long_in_any_tokenization_is_refused_untokenized(http: httpx.Client) -> None:
    response = _complete(http, prompt="x" * 2**20)
    error = _error(response)
    assert error["param"] == "prompt" and "characters" in error["message"]
    content = [{"type": "text", "text": "y" * 2**20}]
    error = _error(_chat(http, messages=[{"role": "user", "content": content}]))
    assert error["param"] == "messages" and "characters" in error["message"]


def test_n_is_bounded(http: httpx.Client) -> None:
    assert _error(_complete(http, n=129))["param"] == "n"
    assert _error(_chat(http, n=50000))["param"] == "n"


def test_responses_are_bounded_before_they_run(http: httpx.Client) -> None:
    """n x positions x logprobs beyond --max-response-logprobs (2^20) is a 400 at admission:
    128 echoed copies of a 900-token prompt with top-20 logprobs would be ~2.4M values (~70 MB
    of JSON) from a 5 kB request."""
    prompt = "hello " * 900
    error = _error(_complete(http, prompt=prompt, n=128, echo=True, logprobs=20, max_tokens=1))
    assert error["param"] == "logprobs" and "limit of 1,048,576" in error["message"]
    error = _error(_chat(http, n=128, logprobs=True, top_logprobs=20, max_tokens=500))
    assert error["param"] == "logprobs"
    # One echoed copy is well within the bound; so is the same prompt without logprobs.
    assert _complete(http, prompt=prompt, echo=True, logprobs=20, max_tokens=1).status_code == 200
    assert _complete(http, prompt=prompt, n=128, echo=True, max_tokens=1).status_code == 200
    wait_until_idle(http)


def test_priority_needs_the_priority_policy(http: httpx.Client) -> None:
    """Under the default fcfs policy no client may jump the queue (vLLM refuses it too)."""
    for response in (_complete(http, priority=-5), _chat(http, priority=2**62)):
        error = _error(response)
        assert error["param"] == "priority" and "--scheduling-policy" in error["message"]
    assert _complete(http, priority=0).status_code == 200


@pytest.mark.parametrize("field", ["top_k", "priority", "min_tokens", "n", "seed", "logprobs"])
def test_integers_that_overflow_the_wire_are_400(http: httpx.Client, field: str) -> None:
    for value in (10**30, -(10**30)):
        body = json.dumps({"prompt": "Hi", "max_tokens": 2, field: value})
        assert _error(_raw(http, "/v1/completions", body))["param"] == field
    raw = '{"prompt": "Hi", "max_tokens": 2, "top_k": 1e30}'
    assert _error(_raw(http, "/v1/completions", raw))["param"] == "top_k"


@pytest.mark.parametrize(
    "route, body",
    [
        ("/v1/completions", {"prompt": "a\ud800b", "max_tokens": 2}),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "stop": ["\udfff"]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud83d"}]}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
        ),
        ("/tokenize", {"prompt": "\ud800"}),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "\ud800": 1}),
    ],
)
def test_lone_surrogates_are_400(http: httpx.Client, route: str, body: dict) -> None:
    raw = json.dumps(body)  # ensure_ascii: the surrogate travels as a \\ud800 escape
    assert "\\ud" in raw
    assert "surrogate" in _error(_raw(http, route, raw))["message"]


@pytest.mark.parametrize(
    "content",
    [[{"type": "text"}], [{"type": "text", "text": 5}], [{"type": "text", "text": None}]],
)
def test_bad_content_parts_are_400(http: httpx.Client, content: list) -> None:
    error = _error(_chat(http, messages=[{"role": "user", "content": content}]))
    assert error["param"].startswith("messages")


def test_tokenize_needs_a_message(http: httpx.Client) -> None:
    body = {"messages": [], "continue_final_message": True, "add_generation_prompt": False}
    assert _error(http.post("/tokenize", json=body))["param"] == "messages"


@pytest.mark.parametrize("name", ["messages", "add_generation_prompt", "tokenize"])
def test_template_kwargs_that_collide_are_400(http: httpx.Client, name: str) -> None:
    error = _error(_chat(http, chat_template_kwargs={name: []}))
    assert error["param"] == "chat_template_kwargs"


def test_template_include_is_400_with_trusted_templates(model_path: str) -> None:
    server = KilnServer(
        ["--dtype", "float32", "--kv-cache-memory", "0.1", "--max-model-len", "256"]
        + ["--uvicorn-log-level", "warning", "--trust-request-chat-template"]
    )
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            error = _error(_chat(http, chat_template="{% include 'other' %}"))
            assert "template" in error["message"]
            ok = _chat(http, chat_template=TEMPLATE, max_tokens=1)
            assert ok.status_code == 200, ok.text
    finally:
        server.stop()


def test_small_contract_breaks(http: httpx.Client) -> None:
    assert _error(_complete(http, max_tokens=-5))["param"] == "max_tokens"
    # The OpenAI SDK's types allow null: it means the default.
    response = _complete(http, n=None, echo=None, logprobs=None, min_tokens=None)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 1
    assert _chat(http, n=None, logprobs=None).status_code == 200
    for raw in (
        '{"prompt": "Hi", "max_tokens": 2, "logit_bias": {"100": NaN}}',
        '{"prompt": "Hi", "max_tokens": 2, "temperature": Infinity}',
        '{"prompt": "Hi", "max_tokens": 2, "top_p": -Infinity}',
    ):
        assert _error(_raw(http, "/v1/completions", raw))


def test_requests_may_share_a_request_id(server: KilnServer) -> None:
    """Both run to the end (each under an engine id of its own), and both answer with the id."""
    results: list[list[Any]] = []
    headers = {"Authorization": f"Bearer {API_KEY}", "X-Request-Id": "same-id"}
    body = {"prompt": "Count: 1, 2,", "max_tokens": 24, "ignore_eos": True, "stream": True}
    barrier = threading.Barrier(2)

    def run() -> None:
        with httpx.Client(base_url=server.url, headers=headers, timeout=60) as http:
            barrier.wait()
            with http.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                results.append(parse_sse(response.iter_lines()))

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(results) == 2
    for events in results:
        assert events[-1] == "[DONE]"
        assert not [e for e in events[:-1] if "error" in e], events
        assert {e["id"] for e in events[:-1]} == {"cmpl-same-id"}
        assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_aborted_requests_are_counted(http: httpx.Client) -> None:
    name, labels = "vllm:request_success_total", {"finished_reason": "abort"}
    before = metric(scrape(http), name, **labels)
    body = {"prompt": "Once", "max_tokens": 500, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        next(line for line in response.iter_lines() if line.startswith("data: "))
    samples = wait_until_idle(http)
    assert metric(samples, name, **labels) == before + 1


def test_unknown_field_names_are_remembered_up_to_a_bound(server: KilnServer) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=30) as http:
        for i in range(MAX_WARNED_FIELDS + 20):
            # max_tokens -5 is refused right after the unknown names are noted: cheap.
            body = {"prompt": "Hi", "max_tokens": -5, f"zz_unknown_{i}": 1}
            assert http.post("/v1/completions", json=body).status_code == 400
    logged = set(re.findall(r"zz_unknown_\d+", server.output()))
    assert 0 < len(logged) <= MAX_WARNED_FIELDS
