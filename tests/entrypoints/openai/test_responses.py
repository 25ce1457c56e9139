"""``/v1/responses`` against a real ``kiln serve`` of the default model (two API keys), through the
official ``openai`` client: text answers equal to chat completions' for the same messages, usage
against transformers' tokenizer, streaming events in the order the SDK expects, the store
(retrieve, delete, cancel, ``previous_response_id``, one namespace per key), a disconnect that
frees the engine, and the 400s of bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from kiln.testing.server import BASE_ARGS, KilnServer, metric, scrape, wait_until_idle

KEY, OTHER_KEY = "key-one", "key-two"
MAX_STORED = 24
SYSTEM = "You are a terse assistant."
QUESTION = "What is the capital of France?"
# Long enough to be in flight while the test acts on it.
LONG = {"structured_outputs": {"regex": "(ab ){400}"}, "max_output_tokens": 900}


@pytest.fixture(scope="module")
def server(model_path: str) -> Iterator[KilnServer]:
    store = ["--responses-store-max-entries", str(MAX_STORED)]
    kiln = KilnServer([*BASE_ARGS, "--api-key", KEY, "--api-key", OTHER_KEY, *store])
    yield kiln
    kiln.stop()


@pytest.fixture(scope="module")
def hf_tokenizer(model_path: str) -> Any:
    from transformers import AutoTokenizer

    folder, name = os.path.split(model_path)
    return AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)


def _client(server: KilnServer, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server: KilnServer) -> Iterator[httpx.Client]:
    """httpx with the first key, for what the SDK does not send or parse (raw events, 400s)."""
    session = httpx.Client(
        base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120
    )
    yield session
    session.close()


@pytest.fixture(scope="module")
def client(server: KilnServer) -> openai.OpenAI:
    return _client(server)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


# -- text -----------------------------------------------------------------------------------------


def test_greedy_answer_equals_chat_completions(client: openai.OpenAI, model: str) -> None:
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
        temperature=0,
        max_completion_tokens=40,
    )
    expected = chat.choices[0].message.content
    assert expected
    inputs: list[Any] = [
        QUESTION,
        [{"role": "user", "content": QUESTION}],
        [
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": QUESTION}],
            }
        ],
    ]
    for given in inputs:
        response = client.responses.create(
            model=model, instructions=SYSTEM, input=given, temperature=0, max_output_tokens=40
        )
        assert response.output_text == expected
        assert response.status == "completed" and response.incomplete_details is None
        assert response.usage is not None
        assert response.usage.input_tokens == chat.usage.prompt_tokens
        assert response.usage.output_tokens == chat.usage.completion_tokens
        (item,) = response.output
        assert item.type == "message" and item.role == "assistant" and item.status == "completed"
        assert response.id.startswith("resp_") and item.id.startswith("msg_")


def test_usage_counts_match_the_tokenizer(client: openai.OpenAI, model: str, hf_tokenizer) -> None:
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Say something."},
        {"role": "assistant", "content": "Something."},
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": QUESTION},
    ]
    response = client.responses.create(
        model=model, input=messages, temperature=0, max_output_tokens=3
    )
    # The model's own template, rendered by transformers.
    expected = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    if not isinstance(expected, list):
        expected = expected["input_ids"]
    usage = response.usage
    assert usage is not None and usage.input_tokens == len(expected)
    # Cut at max_output_tokens: exactly that many tokens, status incomplete.
    assert usage.output_tokens == 3 and usage.total_tokens == len(expected) + 3
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete"


def test_cached_tokens_are_the_prefix_cache_hits(client: openai.OpenAI, model: str) -> None:
    long_input = "Remember these words: " + " ".join(f"w{i}" for i in range(40))
    body = {"model": model, "input": long_input, "temperature": 0, "max_output_tokens": 2}
    client.responses.create(**body)
    again = client.responses.create(**body)
    streamed = list(client.responses.create(**body, stream=True))[-1].response
    block_size = 16  # the server's default
    for usage in (again.usage, streamed.usage):
        # Every full block of the prompt but the last token's (as vLLM: one token is computed).
        expected = (usage.input_tokens - 1) // block_size * block_size
        assert expected > 0 and usage.input_tokens_details.cached_tokens == expected


def test_request_fields_are_echoed(client: openai.OpenAI, model: str) -> None:
    response = client.responses.create(
        model=model,
        input=QUESTION,
        instructions=SYSTEM,
        metadata={"run": "7"},
        user="tester",
        temperature=0.5,
        top_p=0.9,
        max_output_tokens=4,
    )
    assert response.model == model and response.object == "response"
    assert response.metadata == {"run": "7"} and response.user == "tester"
    assert response.instructions == SYSTEM and response.max_output_tokens == 4
    assert response.temperature == 0.5 and response.top_p == 0.9


def test_text_format_json_schema_is_enforced(client: openai.OpenAI, model: str) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    }
    form = {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}
    response = client.responses.create(
        model=model, input=QUESTION, text={"format": form}, temperature=1.0, max_output_tokens=40
    )
    assert json.loads(response.output_text)["city"] in ("Paris", "Rome")
    assert response.text.format.type == "json_schema"
    json_object = client.responses.create(
        model=model,
        input=QUESTION + " Answer in JSON.",
        text={"format": {"type": "json_object"}},
        temperature=0,
        max_output_tokens=60,
        extra_body={"structured_outputs": {"disable_any_whitespace": True}},
    )
    assert isinstance(json.loads(json_object.output_text), dict)


# -- streaming ------------------------------------------------------------------------------------


def _raw_events(http: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The SSE events of a streamed response; each ``event:`` line names its data's type."""
    events = []
    with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        lines = list(response.iter_lines())
    for block in "\n".join(lines).strip().split("\n\n"):
        event_line, data_line = block.split("\n")
        data = json.loads(data_line.removeprefix("data: "))
        assert event_line == f"event: {data['type']}"
        events.append(data)
    return events


def test_stream_events_in_order_and_deltas_equal_the_text(
    http: httpx.Client, client: openai.OpenAI, model: str
) -> None:
    body = {"model": model, "input": QUESTION, "temperature": 0, "max_output_tokens": 40}
    whole = client.responses.create(**body)
    events = _raw_events(http, body)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    types = [e["type"] for e in events]
    num_deltas = types.count("response.output_text.delta")
    assert num_deltas > 1
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * num_deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    final = events[-1]["response"]
    assert text == whole.output_text == final["output"][0]["content"][0]["text"]
    assert events[-2]["item"]["id"] == events[2]["item"]["id"] == final["output"][0]["id"]
    assert final["usage"]["output_tokens"] == whole.usage.output_tokens
    assert final["id"] == events[0]["response"]["id"]


def test_sdk_stream_and_create_stream(client: openai.OpenAI, model: str) -> None:
    body = {"model": model, "input": QUESTION, "temperature": 0, "max_output_tokens": 40}
    whole = client.responses.create(**body)
    with client.responses.stream(**body) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == whole.output_text
    events = list(client.responses.create(**body, stream=True))
    assert events[-1].type == "response.completed"
    assert events[-1].response.output_text == whole.output_text


def _open_stream(http: httpx.Client, body: dict[str, Any]) -> tuple[httpx.Response, Iterator[str]]:
    request = http.build_request("POST", "/v1/responses", json={**body, "stream": True})
    response = http.send(request, stream=True)
    assert response.status_code == 200
    return response, response.iter_lines()


def _first_data(lines: Iterator[str]) -> dict[str, Any]:
    for line in lines:
        if line.startswith("data: "):
            return json.loads(line.removeprefix("data: "))
    raise AssertionError("the stream ended")


def _check_engine_free(http: httpx.Client) -> None:
    samples = wait_until_idle(http)
    for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        assert metric(samples, name) == 0, name


def test_stream_disconnect_frees_the_engine(http: httpx.Client, model: str) -> None:
    response, lines = _open_stream(http, {"model": model, "input": "Write.", **LONG})
    created = _first_data(lines)
    for _ in range(5):
        _first_data(lines)
    assert metric(scrape(http), "vllm:num_requests_running") == 1
    response.close()
    _check_engine_free(http)
    stored = http.get(f"/v1/responses/{created['response']['id']}").json()
    assert stored["status"] == "cancelled"


# -- the store ------------------------------------------------------------------------------------


def test_retrieve_delete_and_per_key_isolation(server: KilnServer, model: str) -> None:
    mine, theirs = _client(server), _client(server, OTHER_KEY)
    response = mine.responses.create(model=model, input=QUESTION, max_output_tokens=4)
    assert mine.responses.retrieve(response.id).model_dump() == response.model_dump()
    with pytest.raises(openai.NotFoundError):
        theirs.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        theirs.responses.create(
            model=model, input="Go on.", previous_response_id=response.id, max_output_tokens=2
        )
    with pytest.raises(openai.NotFoundError):
        theirs.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        theirs.responses.cancel(response.id)
    mine.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        mine.responses.retrieve(response.id)
    unstored = mine.responses.create(model=model, input=QUESTION, max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        mine.responses.retrieve(unstored.id)


def test_the_store_keeps_the_newest_entries_only(server: KilnServer, model: str) -> None:
    mine, theirs = _client(server), _client(server, OTHER_KEY)
    oldest = mine.responses.create(model=model, input="a", max_output_tokens=1)
    # The bound is all keys together: the other key's responses evict this one's.
    newer = [
        theirs.responses.create(model=model, input="b", max_output_tokens=1)
        for _ in range(MAX_STORED)
    ]
    with pytest.raises(openai.NotFoundError):
        mine.responses.retrieve(oldest.id)
    for response in (newer[0], newer[-1]):
        assert theirs.responses.retrieve(response.id).id == response.id


@pytest.mark.parametrize(
    "flag",
    [
        ["--responses-store-ttl", "0"],
        ["--responses-store-max-entries", "-1"],
        ["--responses-store-max-bytes", "-5"],
    ],
)
def test_bad_store_flags_stop_the_start(flag: list[str]) -> None:
    command = [sys.executable, "-m", "kiln.entrypoints.cli", "serve", *flag]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "responses store bounds" in done.stderr


def test_previous_response_id_continues_the_conversation(client: openai.OpenAI, model: str) -> None:
    first = client.responses.create(
        model=model, instructions=SYSTEM, input=QUESTION, temperature=0, max_output_tokens=20
    )
    follow_up = {"role": "user", "content": "And of Italy?"}
    second = client.responses.create(
        model=model,
        previous_response_id=first.id,
        input=[follow_up],
        temperature=0,
        max_output_tokens=20,
    )
    # The same conversation written out (instructions are not carried over, as OpenAI's).
    assistant = {"role": "assistant", "content": first.output_text}
    explicit = client.responses.create(
        model=model,
        input=[{"role": "user", "content": QUESTION}, assistant, follow_up],
        temperature=0,
        max_output_tokens=20,
    )
    assert second.output_text == explicit.output_text
    assert second.usage.input_tokens == explicit.usage.input_tokens > first.usage.input_tokens
    assert second.previous_response_id == first.id


def test_input_items_list_the_conversation(client: openai.OpenAI, model: str) -> None:
    first = client.responses.create(model=model, input=QUESTION, max_output_tokens=3)
    given = [{"role": "user", "content": "More?"}]
    second = client.responses.create(
        model=model, previous_response_id=first.id, input=given, max_output_tokens=3
    )
    page = client.responses.input_items.list(second.id, order="asc")
    kinds = [(item.type, getattr(item, "role", None)) for item in page.data]
    assert kinds == [("message", "user"), ("message", "assistant"), ("message", "user")]
    assert page.data[1].id == first.output[0].id and not page.has_more
    newest = client.responses.input_items.list(second.id, limit=1)  # desc by default
    assert [item.id for item in newest.data] == [page.data[-1].id] and newest.has_more
    rest = client.responses.input_items.list(second.id, limit=5, after=newest.data[0].id)
    assert [item.id for item in rest.data] == [page.data[1].id, page.data[0].id]
    with pytest.raises(openai.BadRequestError):
        client.responses.input_items.list(second.id, limit=101)


def test_cancel_aborts_a_response_in_flight(http: httpx.Client, model: str) -> None:
    response, lines = _open_stream(http, {"model": model, "input": "Write.", **LONG})
    try:
        response_id = _first_data(lines)["response"]["id"]
        _first_data(lines)
        cancelled = http.post(f"/v1/responses/{response_id}/cancel")
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
        rest = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    finally:
        response.close()
    assert rest[-1]["type"] == "response.incomplete"
    assert rest[-1]["response"]["status"] == "cancelled"
    _check_engine_free(http)
    # A finished response cannot be cancelled (as OpenAI answers one not in progress).
    again = http.post(f"/v1/responses/{response_id}/cancel")
    assert again.status_code == 400 and again.json()["error"]["param"] == "response_id"


def test_in_progress_response_is_visible(http: httpx.Client, model: str) -> None:
    response, lines = _open_stream(http, {"model": model, "input": "Write.", **LONG})
    try:
        response_id = _first_data(lines)["response"]["id"]
        assert http.get(f"/v1/responses/{response_id}").json()["status"] == "in_progress"
        refused = http.post(
            "/v1/responses",
            json={"model": model, "input": "x", "previous_response_id": response_id},
        )
        assert refused.status_code == 400
    finally:
        response.close()
    wait_until_idle(http)


# -- bad input ------------------------------------------------------------------------------------

BAD_BODIES = [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].name"),
    ({"tools": [{"type": "function", "name": f"f{i}"} for i in range(129)]}, "tools"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"input": [{"role": "user", "content": "hi"}] * 2049}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
        "input[0].content[0].type",
    ),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"k": "v" * 513}}, "metadata"),
    ({"max_output_tokens": -1}, "max_output_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"stream": "maybe"}, "stream"),
]


@pytest.mark.parametrize(("fields", "param"), BAD_BODIES)
def test_bad_fields_are_400_naming_them(
    http: httpx.Client, model: str, fields: dict[str, Any], param: str
) -> None:
    answer = http.post("/v1/responses", json={"model": model, "input": "hi", **fields})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "BadRequestError" and error["param"] == param, error


def test_unknown_ids_are_404(http: httpx.Client, model: str) -> None:
    body = {"model": model, "input": "hi", "previous_response_id": "resp_nope"}
    answer = http.post("/v1/responses", json=body)
    assert answer.status_code == 404
    assert answer.json()["error"]["param"] == "previous_response_id"
    for method, path in [
        ("GET", "/v1/responses/resp_nope"),
        ("DELETE", "/v1/responses/resp_nope"),
        ("POST", "/v1/responses/resp_nope/cancel"),
        ("GET", "/v1/responses/resp_nope/input_items"),
    ]:
        assert http.request(method, path).status_code == 404
    unknown_model = http.post("/v1/responses", json={"model": "nope", "input": "hi"})
    assert unknown_model.status_code == 404 and unknown_model.json()["error"]["param"] == "model"


def test_openapi_lists_the_routes_and_their_statuses(server: KilnServer) -> None:
    paths = httpx.get(f"{server.url}/openapi.json", timeout=30).json()["paths"]
    create = paths["/v1/responses"]["post"]["responses"]
    assert {"200", "400", "401", "404", "413", "503"} <= set(create)
    stored = paths["/v1/responses/{response_id}"]
    assert {"get", "delete"} <= set(stored) and "404" in stored["get"]["responses"]
    cancel = paths["/v1/responses/{response_id}/cancel"]["post"]["responses"]
    assert {"400", "404"} <= set(cancel)
