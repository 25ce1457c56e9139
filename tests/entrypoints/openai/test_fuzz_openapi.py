"""Property-based fuzzing of a live ``kiln serve``, driven by the server's own OpenAPI schema.

Contract. For each route family (``/v1/completions``; ``/v1/chat/completions``;
``/v1/responses`` and its stored-response routes; ``/tokenize`` and ``/detokenize``;
``/v1/embeddings``, ``/pooling`` and ``/score``; the GET routes) schemathesis turns the schema
FastAPI serves at ``/openapi.json`` into requests: first its coverage cases (boundary values,
missing and extra fields, wrong types, unexpected methods; deterministic, so every run repeats
them; at most half the family's time), then, until the family's share of the budget is spent,
random valid and invalid bodies from hypothesis and valid bodies with one hostile value
(``HOSTILE_VALUES``: lone surrogates, integers past int64, NaN and infinities, wrong types, Jinja
that reaches outside the messages) put in one field or nested place (``_slots``). The schema is the
served one with the ranges and shapes it leaves open filled in (``_enrich``). Every request must:

- get an answer below 500 (also inside an SSE stream), with the connection kept (no reset);
- answer within ``REQUEST_TIMEOUT_S`` (a hang fails the case);
- carry an OpenAI error body (``{"error": {"message": str, ...}}``) when it is refused (4xx);
- get a status the served document lists for its operation (a method the document does not have
  for the path, 405, is not checked);

and ``/health`` must answer 200 within ``HEALTH_LATENCY_S`` throughout (a thread polls it while
the family runs) and after. The test collects every failing case, then fails naming each kind of
failure once, with the smallest body that shows it (the exact bytes sent).

Budget: ``KILN_FUZZ_SECONDS`` (default 100: about 2 minutes with the server's start) for all
families together, split by ``SHARES``; a developer fuzzes longer with e.g.
``KILN_FUZZ_SECONDS=1800``. The random phase draws a new seed each run (so that CI explores
further every time) and prints it; ``KILN_FUZZ_SEED`` replays one. The coverage phase is always
the same.

Cost: the server runs with ``--max-model-len 128``, and ``_cheapen`` bounds what a valid request
can cost: a positive ``max_tokens`` above 2 becomes 2, a request without a token limit gets 2,
and at most 4 prompts go in one request; ``--max-n 2`` makes the server refuse a larger ``n``.
Everything else is sent as generated.

Known failures: ``KNOWN_FAILURES`` lists request shapes that still fail (reported, not fixed
yet); cases of those shapes are not sent, so that main stays green. ``KILN_FUZZ_KNOWN=1`` sends
them too. Remove an entry once its fix lands.
"""

from __future__ import annotations

import copy
import json
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import hypothesis
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from kiln.testing.server import API_KEY, KilnServer

pytestmark = pytest.mark.slow

BUDGET_S = float(os.environ.get("KILN_FUZZ_SECONDS", "100"))
SEED = int(os.environ["KILN_FUZZ_SEED"]) if os.environ.get("KILN_FUZZ_SEED") else None
SEND_KNOWN = os.environ.get("KILN_FUZZ_KNOWN", "") not in ("", "0")
# Shares of the budget; the generating routes cost most per case.
SHARES = {
    "completions": 0.27,
    "chat": 0.27,
    "responses": 0.14,
    "tokenize": 0.12,
    "pooling": 0.1,
    "get": 0.1,
}
FAMILIES = {
    "completions": [("/v1/completions", "POST")],
    "chat": [("/v1/chat/completions", "POST")],
    "responses": [
        ("/v1/responses", "POST"),
        ("/v1/responses/{response_id}", "GET"),
        ("/v1/responses/{response_id}", "DELETE"),
        ("/v1/responses/{response_id}/input_items", "GET"),
        ("/v1/responses/{response_id}/cancel", "POST"),
    ],
    "tokenize": [("/tokenize", "POST"), ("/detokenize", "POST")],
    # On this generate server a valid body is a 400 naming --runner pooling; the family checks
    # the routes' validation and statuses (tests/entrypoints/openai/test_embeddings.py serves
    # them).
    "pooling": [
        ("/v1/embeddings", "POST"),
        ("/pooling", "POST"),
        ("/score", "POST"),
        ("/v1/score", "POST"),
    ],
    "get": [
        ("/v1/models", "GET"),
        ("/health", "GET"),
        ("/metrics", "GET"),
        ("/version", "GET"),
        ("/debug/plugins", "GET"),
    ],
}

MAX_MODEL_LEN = 128
MAX_TOKENS = 2
MAX_N = 2
MAX_PROMPTS = 4
REQUEST_TIMEOUT_S = 30.0
HEALTH_LATENCY_S = 5.0
HEALTH_PERIOD_S = 0.25
KEEP_ALIVE_IDLE_S = 4.0  # kiln serve closes a connection idle for 5 s
COVERAGE_SHARE = 0.5
BATCH = 25  # hypothesis examples per run; runs repeat until the family's budget is spent

SERVER_ARGS = [
    "--kv-cache-memory",
    "0.25",
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--max-num-seqs",
    "8",
    # Larger n is refused (400), so that n as generated costs little.
    "--max-n",
    str(MAX_N),
    "--api-key",
    API_KEY,
    "--disable-log-stats",
    "--uvicorn-log-level",
    "warning",
]


# ---------------------------------------------------------------------------------------------
# Known failures: (description, predicate on (path, body)). A case a predicate matches is not sent
# unless KILN_FUZZ_KNOWN=1. Each entry has a reproduction; remove it with its fix.
# ---------------------------------------------------------------------------------------------


KNOWN_FAILURES: list[tuple[str, Callable[[str, Any], bool]]] = []


def _known(path: str, body: Any) -> str | None:
    if SEND_KNOWN:
        return None
    for name, predicate in KNOWN_FAILURES:
        if predicate(path, body):
            return name
    return None


# ---------------------------------------------------------------------------------------------
# Schema and cost
# ---------------------------------------------------------------------------------------------


# Ranges the server accepts (SamplingParams and the serving classes check them; the served schema
# has only types). Given to the generator, they make valid requests valid in every field, so that
# an invalid request is invalid in the one field schemathesis broke, and they make it break each
# range from both sides (huge integers included). Cost-driving fields get cheap ranges.
_SAMPLING_RANGES: dict[str, dict[str, float]] = {
    "n": {"minimum": 1, "maximum": MAX_N},
    "temperature": {"minimum": 0, "maximum": 2},
    "top_p": {"exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"minimum": -1, "maximum": 50},
    "min_p": {"minimum": 0, "maximum": 1},
    "presence_penalty": {"minimum": -2, "maximum": 2},
    "frequency_penalty": {"minimum": -2, "maximum": 2},
    "repetition_penalty": {"exclusiveMinimum": 0, "maximum": 2},
    "min_tokens": {"minimum": 0, "maximum": 1},
    "priority": {"minimum": -10, "maximum": 10},
    "max_tokens": {"minimum": 1, "maximum": MAX_TOKENS},
    "max_completion_tokens": {"minimum": 1, "maximum": MAX_TOKENS},
    "max_output_tokens": {"minimum": 1, "maximum": MAX_TOKENS},
    "logprobs": {"minimum": 0, "maximum": 5},
    "top_logprobs": {"minimum": 0, "maximum": 5},
    "prompt_logprobs": {"minimum": 0, "maximum": 5},
}
VOCAB_SIZE = 49152  # SmolLM2's
_TOKEN_ID = {"type": "integer", "minimum": 0, "maximum": VOCAB_SIZE - 1}


def _options(prop: dict[str, Any], json_type: str) -> Iterator[dict[str, Any]]:
    """The parts of a property schema (itself, or its ``anyOf`` options) of ``json_type``."""
    for option in prop.get("anyOf", [prop]):
        if option.get("type") == json_type:
            yield option


def _enrich(raw: dict[str, Any], model_name: str) -> dict[str, Any]:
    """The served schema with what it leaves open given the shapes the server acts on.

    - numeric fields get the ranges in ``_SAMPLING_RANGES``, token ids the vocabulary's;
    - ``model`` is the served name or null;
    - chat ``content`` parts may be text parts (``{"type": "text", "text": ...}``), and ``role``
      one of the known roles: the served schema has any object and any string, which random
      generation almost never turns into either. Both stay open (any object, any string).
    """
    schema = copy.deepcopy(raw)
    components = schema["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest", "ResponsesRequest"):
        props = components[name]["properties"]
        for field_name, limits in _SAMPLING_RANGES.items():
            for option in _options(props.get(field_name, {}), "integer"):
                option.update(limits)
            for option in _options(props.get(field_name, {}), "number"):
                option.update(limits)
        for option in _options(props.get("stop_token_ids", {}), "array"):
            option["items"] = _TOKEN_ID
        for option in _options(props.get("logit_bias", {}), "object"):
            option["propertyNames"] = {"pattern": "^[0-9]{1,5}$"}
            option["additionalProperties"] = {"type": "number", "minimum": -100, "maximum": 100}
    for name in (
        "CompletionRequest",
        "ChatCompletionRequest",
        "TokenizeRequest",
        "DetokenizeRequest",
        "ResponsesRequest",
    ):
        props = components.get(name, {}).get("properties", {})
        if "model" in props:
            props["model"] = {"anyOf": [{"enum": [model_name]}, {"type": "null"}]}
    for option in _options(
        components["CompletionRequest"]["properties"].get("prompt", {}), "array"
    ):
        items = option.get("items", {})
        if items.get("type") == "integer":
            option["items"] = _TOKEN_ID
            option["minItems"] = 1
        elif items.get("type") == "array":
            option["items"] = {"type": "array", "items": _TOKEN_ID, "minItems": 1}
    # Valid only when absent or null (unsupported, or refused unless they match other fields).
    only_null = {
        "CompletionRequest": ("best_of", "suffix"),
        "ChatCompletionRequest": ("chat_template", "chat_template_kwargs", "tools", "tool_choice"),
    }
    for name, fields in only_null.items():
        for field_name in fields:
            if field_name in components[name]["properties"]:
                components[name]["properties"][field_name] = {"type": "null"}
    completion = components["CompletionRequest"]
    completion["required"] = sorted({*completion.get("required", []), "prompt"})
    for option in _options(completion["properties"].get("prompt", {}), "string"):
        option["minLength"] = 1
    tokens = components["DetokenizeRequest"]["properties"].get("tokens", {})
    for option in _options(tokens, "array"):
        option["items"] = _TOKEN_ID

    responses = components["ResponsesRequest"]
    # Input that answers: text, or a few message items; the refused fields only when false/null.
    item = {
        "type": "object",
        "properties": {
            "role": {"enum": ["user", "system", "developer", "assistant"]},
            "content": {"type": "string"},
        },
        "required": ["role", "content"],
    }
    responses["properties"]["input"] = {
        "anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "items": item, "minItems": 1, "maxItems": MAX_PROMPTS},
        ]
    }
    responses["required"] = sorted({*responses.get("required", []), "input"})
    for field_name in ("background", "top_logprobs", "previous_response_id", "tools"):
        responses["properties"][field_name] = {"type": "null"}

    message = components["ChatMessage"]["properties"]
    message["role"] = {
        "anyOf": [
            {"enum": ["system", "user", "assistant", "tool", "developer"]},
            {"type": "string"},
        ]
    }
    text_part = {
        "type": "object",
        "properties": {"type": {"enum": ["text", "image_url"]}, "text": {}},
        "required": ["type"],
    }
    for option in _options(message.get("content", {}), "array"):
        option["items"] = {"anyOf": [text_part, {"type": "object"}]}
    # Null or absent content is refused by the chat template: valid requests carry some.
    message["content"] = {
        "anyOf": [o for o in message["content"]["anyOf"] if o.get("type") != "null"]
    }
    chat_message = components["ChatMessage"]
    chat_message["required"] = sorted({*chat_message.get("required", []), "content"})
    return schema


def _cheapen(path: str, body: Any) -> Any:
    """Bound what a valid request can cost (see the module docstring); keeps invalid values."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        value = body.get(key)
        if type(value) is int and MAX_TOKENS < value <= MAX_MODEL_LEN:
            body[key] = MAX_TOKENS
    # No limit means 16 tokens (completions) or the rest of the context (chat).
    if path == "/v1/completions" and body.get("max_tokens") is None:
        body["max_tokens"] = MAX_TOKENS
    if path == "/v1/chat/completions" and all(
        body.get(key) is None for key in ("max_tokens", "max_completion_tokens")
    ):
        body["max_completion_tokens"] = MAX_TOKENS
    if path == "/v1/responses" and body.get("max_output_tokens") is None:
        body["max_output_tokens"] = MAX_TOKENS
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        body["prompt"] = prompt[:MAX_PROMPTS]
    return body


# ---------------------------------------------------------------------------------------------
# Hostile values: what the schema cannot say. Each is put in one place of a valid request.
# ---------------------------------------------------------------------------------------------

HOSTILE_VALUES: list[Any] = [
    # lone surrogates and odd text
    "\ud800",
    "x\udfffy",
    "\x00",
    "",
    "\u202e\ufeff",
    # integers beyond the wire encoding (int64 / uint64) and floats beyond reason
    2**63,
    2**64,
    -(2**63) - 1,
    10**30,
    float("nan"),
    float("inf"),
    float("-inf"),
    1e308,
    -0.0,
    # other types
    True,
    None,
    [],
    {},
    [[]],
    {"": None},
    # chat templates that reach outside the message list or do not compile
    "{% include 'x' %}",
    "{% extends 'x' %}",
    "{% import 'x' as y %}",
    "{{ raise_exception('x') }}",
    "{% for %}",
]


def _set(key: str) -> Callable[[dict, Any], dict]:
    return lambda body, value: {**body, key: value}


def _in_message(build: Callable[[Any], dict]) -> Callable[[dict, Any], dict]:
    def place(body: dict, value: Any) -> dict:
        messages = list(body.get("messages") or [{"role": "user", "content": "hi"}])
        messages[-1] = {**messages[-1], **build(value)}
        return {**body, "messages": messages}

    return place


def _slots(properties: list[str], path: str) -> list[Callable[[dict, Any], dict]]:
    """Places for a hostile value: each top-level field, and the nested ones the server reads."""
    slots = [_set(name) for name in properties]
    if "messages" in properties:
        slots += [
            _in_message(lambda v: {"content": v}),
            _in_message(lambda v: {"role": v}),
            _in_message(lambda v: {"name": v}),
            _in_message(lambda v: {"content": [{"type": "text", "text": v}]}),
            _in_message(lambda v: {"content": [{"type": v, "text": "hi"}]}),
        ]
    if "input" in properties:  # /v1/responses: an item's role, content, part and type
        slots += [
            lambda b, v: {**b, "input": [{"role": "user", "content": v}]},
            lambda b, v: {**b, "input": [{"role": v, "content": "hi"}]},
            lambda b, v: {**b, "input": [{"role": "user", "content": [{"type": v, "text": "a"}]}]},
            lambda b, v: {**b, "input": [{"type": v, "call_id": "c", "output": "x"}]},
            lambda b, v: {**b, "tools": [{"type": "function", "name": "f", "parameters": v}]},
        ]
    if "chat_template_kwargs" in properties:
        slots += [
            lambda b, v: {**b, "chat_template_kwargs": {"x": v}},
            lambda b, v: {**b, "chat_template_kwargs": {"messages": v}},
            lambda b, v: {**b, "chat_template_kwargs": {"add_generation_prompt": v}},
        ]
    if "stop" in properties:
        slots.append(lambda b, v: {**b, "stop": ["a", v]})
    if "logit_bias" in properties:
        slots += [
            lambda b, v: {**b, "logit_bias": {"0": v}},
            lambda b, v: {**b, "logit_bias": {str(v): 1}},
        ]
    for name in ("stop_token_ids", "tokens"):
        if name in properties:
            slots.append(lambda b, v, name=name: {**b, name: [0, v]})
    if path == "/v1/completions":
        slots += [
            lambda b, v: {**b, "prompt": [v]},
            lambda b, v: {**b, "prompt": [[0, v]]},
        ]
    return slots


def _hostile(operation, path: str, properties: list[str]) -> st.SearchStrategy:
    """Valid requests of ``operation`` with one hostile value put in one place."""
    return st.builds(
        lambda case, place, value: place(dict(case.body), value),
        operation.as_strategy(GenerationMode.POSITIVE),
        st.sampled_from(_slots(properties, path)),
        st.sampled_from(HOSTILE_VALUES),
    )


# ---------------------------------------------------------------------------------------------
# Sending a case and checking the answer
# ---------------------------------------------------------------------------------------------


@dataclass
class Failure:
    kind: str
    method: str
    path: str
    content: bytes | None
    detail: str

    def reproduction(self, url: str) -> str:
        command = f"curl -sS -X {self.method} {url}{self.path} -H 'Authorization: Bearer {API_KEY}'"
        if self.content is not None:
            body = self.content.decode("utf-8", "backslashreplace")
            command += f" -H 'Content-Type: application/json' --data-binary '{body}'"
        return command


@dataclass
class Outcome:
    sent: int = 0
    by_status: dict[int, int] = field(default_factory=dict)
    skipped_known: dict[str, int] = field(default_factory=dict)
    failures: dict[str, Failure] = field(default_factory=dict)
    previous: tuple[str, str, bytes | None, float] | None = None
    """The last request answered, and when."""
    seed: int = field(default_factory=lambda: SEED if SEED is not None else random.randrange(2**32))
    refusals: dict[str, int] = field(default_factory=dict)
    documented: dict[tuple[str, str], set[str]] = field(default_factory=dict)
    """``(METHOD, path)`` -> the statuses the served OpenAPI document lists for it."""

    def fail(self, failure: Failure) -> None:
        key = f"{failure.kind} {failure.method} {failure.path}: {failure.detail[:120]}"
        size = len(failure.content or b"")
        if key not in self.failures:
            self.failures[key] = failure
        elif failure.kind not in ("hang", "connection"):
            # The smallest case shows it best; but the first hang is the one that caused the
            # others, which may be smaller.
            if size < len(self.failures[key].content or b""):
                self.failures[key] = failure


def _encode(body: Any) -> bytes | None:
    if body is None:
        return None
    if isinstance(body, bytes):
        return body
    # json.dumps escapes lone surrogates and writes NaN/Infinity, as careless clients do.
    return json.dumps(body).encode()


def _error_body_problem(content: bytes) -> str | None:
    try:
        body = json.loads(content)
        message = body["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return f"not an OpenAI error body: {content[:200]!r}"
    return None if isinstance(message, str) and message else "error.message is not a string"


def _exchange(
    http: httpx.Client, method: str, path: str, content: bytes | None, headers: dict[str, str]
) -> tuple[httpx.Response, bytes]:
    """One request; the whole answer must arrive within ``REQUEST_TIMEOUT_S``."""
    start = time.monotonic()
    request = http.build_request(method, path, content=content, headers=headers)
    response = http.send(request, stream=True)
    try:
        chunks = []
        for chunk in response.iter_bytes():
            chunks.append(chunk)
            if time.monotonic() - start > REQUEST_TIMEOUT_S:
                raise httpx.ReadTimeout("the whole answer took too long")
        return response, b"".join(chunks)
    finally:
        response.close()


def _send(http: httpx.Client, method: str, path: str, body: Any, headers: dict, out: Outcome):
    content = _encode(body)
    request_headers = {"Authorization": f"Bearer {API_KEY}", **headers}
    if content is not None:
        request_headers.setdefault("Content-Type", "application/json")
    out.sent += 1
    previous, out.previous = out.previous, None
    started = time.monotonic()
    try:
        try:
            response, payload = _exchange(http, method, path, content, request_headers)
        except httpx.TransportError as exc:
            if isinstance(exc, httpx.TimeoutException) or previous is None:
                raise
            # A reset on a kept-alive connection is the previous answer's fault (the server
            # closed the connection without saying so) when the same request works on a new one,
            # unless the connection sat idle long enough for the server to close it.
            response, payload = _exchange(http, method, path, content, request_headers)
            if started - previous[3] < KEEP_ALIVE_IDLE_S:
                detail = f"the next request on the connection got {type(exc).__name__}: {exc}"
                out.fail(Failure("keep-alive dropped", *previous[:3], detail))
        out.previous = (method, path, content, time.monotonic())
    except httpx.TimeoutException as exc:
        out.fail(
            Failure("hang", method, path, content, f"no answer in {REQUEST_TIMEOUT_S} s: {exc}")
        )
        return
    except httpx.TransportError as exc:
        out.fail(Failure("connection", method, path, content, f"{type(exc).__name__}: {exc}"))
        return
    status = response.status_code
    out.by_status[status] = out.by_status.get(status, 0) + 1
    documented = out.documented.get((method.upper(), path))
    if documented is not None and str(status) not in documented:
        detail = f"{status} is not among the documented {sorted(documented)}"
        out.fail(Failure("undocumented status", method, path, content, detail))
    if status >= 500:
        detail = payload[:300].decode("utf-8", "replace")
        out.fail(Failure(f"HTTP {status}", method, path, content, detail))
    elif status >= 400 and path != "/health":
        problem = _error_body_problem(payload)
        if problem:
            out.fail(Failure(f"HTTP {status} body", method, path, content, problem))
        else:
            reason = json.loads(payload)["error"]["message"][:50]
            out.refusals[reason] = out.refusals.get(reason, 0) + 1
    elif response.headers.get("content-type", "").startswith("text/event-stream"):
        for line in payload.decode("utf-8", "replace").splitlines():
            if not line.startswith("data: {"):
                continue
            data = json.loads(line[len("data: ") :])
            # Chat's error chunk, or a Responses ``error`` event (its code a string).
            error = data if data.get("type") == "error" else data.get("error")
            if isinstance(error, dict) and int(error.get("code") or 0) >= 500:
                detail = str(error.get("message"))[:300]
                out.fail(Failure("in-stream 5xx", method, path, content, detail))


class HealthPoller(threading.Thread):
    """Polls ``/health`` until stopped; records every answer that is not a prompt 200."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.stop_event = threading.Event()
        self.problems: list[str] = []
        self.polls = 0
        self.worst_s = 0.0

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=HEALTH_LATENCY_S) as http:
            while not self.stop_event.wait(HEALTH_PERIOD_S):
                start = time.monotonic()
                try:
                    status = http.get("/health").status_code
                except httpx.HTTPError as exc:
                    status = f"{type(exc).__name__}"
                elapsed = time.monotonic() - start
                self.polls += 1
                self.worst_s = max(self.worst_s, elapsed)
                if status != 200 or elapsed > HEALTH_LATENCY_S:
                    self.problems.append(f"/health answered {status} after {elapsed:.1f} s")

    def stop(self) -> None:
        self.stop_event.set()
        self.join(HEALTH_LATENCY_S + 5)


# ---------------------------------------------------------------------------------------------
# Fixtures and the test
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fuzz_server(model_path: str) -> Iterator[KilnServer]:
    kiln = KilnServer(SERVER_ARGS)
    yield kiln
    kiln.stop()


@pytest.fixture(scope="module")
def schema(fuzz_server: KilnServer):
    raw = httpx.get(f"{fuzz_server.url}/openapi.json", timeout=30).json()
    headers = {"Authorization": f"Bearer {API_KEY}"}
    models = httpx.get(f"{fuzz_server.url}/v1/models", headers=headers, timeout=30).json()
    enriched = _enrich(raw, models["data"][0]["id"])
    # The request fields of each POST route, for the hostile values.
    properties = {}
    for path, item in enriched["paths"].items():
        body = item.get("post", {}).get("requestBody", {}).get("content", {})
        ref = body.get("application/json", {}).get("schema", {}).get("$ref", "")
        component = enriched["components"]["schemas"].get(ref.rsplit("/", 1)[-1], {})
        properties[path] = sorted(component.get("properties", {}))
    documented = {
        (method.upper(), path): set(operation.get("responses", {}))
        for path, item in raw["paths"].items()
        for method, operation in item.items()
    }
    return schemathesis.openapi.from_dict(enriched), properties, documented


def _auth_headers() -> st.SearchStrategy[dict[str, str]]:
    """Headers for the GET family: the right key, none, or any latin-1 ``Authorization``."""
    # Values HTTP allows (visible characters, inner spaces): others the client refuses to send.
    char = st.characters(codec="latin-1", exclude_categories=["Cc", "Zs"])
    value = st.text(st.one_of(char, st.just(" ")), max_size=40).map(str.strip)
    return st.one_of(
        st.just({}),
        st.builds(lambda v: {"Authorization": v.encode("latin-1")}, value),
        st.builds(lambda v: {"Authorization": f"Bearer {v}".strip().encode("latin-1")}, value),
    )


def _run_family(family: str, schema, url: str, out: Outcome, deadline: float) -> None:
    schema, request_properties, out.documented = schema

    def send(http: httpx.Client, method: str, path: str, body: Any, headers: dict) -> None:
        body = _cheapen(path, body)
        known = _known(path, body)
        if known:
            out.skipped_known[known] = out.skipped_known.get(known, 0) + 1
            return
        _send(http, method, path, body, headers, out)

    def body_of(case) -> Any:
        body = case.body
        return None if type(body).__name__ == "NotSet" else body

    with httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT_S) as http:
        operations = [schema[path][method] for path, method in FAMILIES[family]]
        # Coverage cases first: deterministic boundaries and type violations of every field; the
        # invalid ones first, since they are cheap (refused before the engine) and find most.
        # They get at most COVERAGE_SHARE of the time: the random phase finds other things.
        coverage_deadline = time.monotonic() + COVERAGE_SHARE * (deadline - time.monotonic())
        modes = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]
        for mode in reversed(modes):
            for operation in operations:
                config = schema.config.generation_for(operation=operation)
                for case in schema.iter_coverage_cases(
                    operation, generation_modes=[mode], generation_config=config
                ):
                    if time.monotonic() > coverage_deadline:
                        break
                    headers = dict(case.headers or {})
                    send(http, case.method, case.formatted_path, body_of(case), headers)

        # Then random valid and invalid requests, and valid ones with one hostile value, in runs
        # of BATCH, until the budget is spent.
        def request_of(case) -> tuple[str, str, Any, dict]:
            return case.method, case.formatted_path, body_of(case), dict(case.headers or {})

        strategies = [
            operation.as_strategy(mode).map(request_of)
            for operation in operations
            for mode in modes
        ]
        for (path, method), operation in zip(FAMILIES[family], operations, strict=True):
            properties = request_properties.get(path)
            if properties:
                hostile = _hostile(operation, path, properties)
                strategies.append(hostile.map(lambda body, m=method, p=path: (m, p, body, {})))
        header_strategy = _auth_headers() if family == "get" else st.just({})

        @settings(
            max_examples=BATCH,
            deadline=None,
            database=None,
            derandomize=False,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(request=st.one_of(strategies), extra_headers=header_strategy)
        def fuzz(request, extra_headers) -> None:
            if time.monotonic() > deadline:
                return
            method, path, body, headers = request
            send(http, method, path, body, {**headers, **extra_headers})

        # Run i is seeded with seed + i: the same seed gives the same requests, in the same order.
        run = 0
        while time.monotonic() < deadline:
            hypothesis.seed(out.seed + run)(fuzz)()
            run += 1


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fuzz_family(family: str, fuzz_server: KilnServer, schema) -> None:
    budget = BUDGET_S * SHARES[family]
    out = Outcome()
    poller = HealthPoller(fuzz_server.url)
    poller.start()
    try:
        _run_family(family, schema, fuzz_server.url, out, time.monotonic() + budget)
    finally:
        poller.stop()
    after = httpx.get(f"{fuzz_server.url}/health", timeout=HEALTH_LATENCY_S).status_code
    print(
        f"\nfuzz {family} (KILN_FUZZ_SEED={out.seed}): {out.sent} requests in {budget:.0f} s, "
        f"statuses {out.by_status}, "
        f"known shapes not sent {out.skipped_known}, /health polled {poller.polls}x "
        f"(slowest {poller.worst_s:.2f} s)"
    )
    top = sorted(out.refusals.items(), key=lambda item: -item[1])[:8]
    print("most common refusals: " + "; ".join(f"{n}x {reason!r}" for reason, n in top))
    report = [
        f"{key}\n    {failure.reproduction(fuzz_server.url)}"
        for key, failure in sorted(out.failures.items())
    ]
    report += poller.problems[:10]
    if after != 200:
        report.append(f"/health answered {after} after the run")
    assert out.sent > 0, "no request was sent"
    assert not report, (
        f"{len(report)} problem(s) fuzzing {family} (KILN_FUZZ_SEED={out.seed}):\n"
        + "\n".join(report)
    )
