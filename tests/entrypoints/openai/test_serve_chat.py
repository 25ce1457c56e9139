"""``POST /v1/chat/completions`` against a real server: shapes, fields, streaming."""

from __future__ import annotations

import httpx
import openai
import pytest

from kiln.testing.server import stream_events

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_response_shape(http: httpx.Client, model_name: str) -> None:
    response = http.post(
        "/v1/chat/completions",
        json={"messages": MESSAGES, "max_completion_tokens": 5, "temperature": 0},
    )
    assert response.status_code == 200
    body = response.json()
    assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["model"] == model_name
    (choice,) = body["choices"]
    assert set(choice) == {"index", "message", "logprobs", "finish_reason", "stop_reason"}
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    tokenized = http.post("/tokenize", json={"messages": MESSAGES}).json()
    assert body["usage"] == {
        "prompt_tokens": tokenized["count"],
        "completion_tokens": 5,
        "total_tokens": tokenized["count"] + 5,
    }


def test_chat_stream_matches_non_stream(client: openai.OpenAI, model_name: str) -> None:
    kwargs = {"model": model_name, "messages": MESSAGES, "max_tokens": 12, "temperature": 0}
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]


def test_chat_stream_usage_and_n(http: httpx.Client) -> None:
    body = {
        "messages": MESSAGES,
        "max_tokens": 4,
        "n": 2,
        "temperature": 1.0,
        "seed": 3,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    *chunks, last, done = stream_events(http, "/v1/chat/completions", body)
    assert done == "[DONE]" and last["choices"] == []
    assert last["usage"]["completion_tokens"] == 8
    roles = [c["choices"][0]["index"] for c in chunks if "role" in c["choices"][0]["delta"]]
    assert sorted(roles) == [0, 1]
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert "role" in mine[0]["delta"]
        assert [c["finish_reason"] for c in mine].count("length") == 1
        assert mine[-1]["finish_reason"] == "length"


def test_chat_logprobs(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model=None,  # type: ignore[arg-type]
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = completion.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    assert "".join(entry.token for entry in content) == completion.choices[0].message.content
    for entry in content:
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token  # greedy: the top token
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=None,  # type: ignore[arg-type]
            messages=MESSAGES,  # type: ignore[arg-type]
            logprobs=True,
            top_logprobs=21,
            stream=True,
        )


def test_chat_fields(http: httpx.Client) -> None:
    def chat(**fields: object) -> dict:
        body = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0, **fields}
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()

    base = chat()["choices"][0]["message"]["content"]
    parts = [{"role": "user", "content": [{"type": "text", "text": MESSAGES[0]["content"]}]}]
    assert chat(messages=parts)["choices"][0]["message"]["content"] == base
    assert chat(max_completion_tokens=2)["usage"]["completion_tokens"] == 2
    assert chat(response_format={"type": "json_object"})["choices"]
    assert chat(response_format={"type": "text"})["choices"][0]["message"]["content"] == base
    assert chat(chat_template_kwargs={"unused": True}, seed=1, stop=["zzz"], user="u")["choices"]
    assert chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="none")
    # Without a generation prompt the template does not open an assistant turn.
    with_prompt = http.post("/tokenize", json={"messages": MESSAGES}).json()["count"]
    without = http.post(
        "/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}
    ).json()["count"]
    assert without < with_prompt
    assert chat(add_generation_prompt=False)["usage"]["prompt_tokens"] == without
    # continue_final_message continues the assistant's text instead of starting a new turn.
    partial = [*MESSAGES, {"role": "assistant", "content": "The capital of France is"}]
    continued = chat(messages=partial, add_generation_prompt=False, continue_final_message=True)
    assert continued["choices"][0]["message"]["content"]


@pytest.mark.parametrize(
    "messages",
    [None, "s", [123], [{}], [{"role": "user", "content": 123}], []],
    ids=["none", "string", "int", "empty-dict", "int-content", "empty-list"],
)
def test_invalid_messages_are_400(http: httpx.Client, messages: object) -> None:
    response = http.post("/v1/chat/completions", json={"messages": messages})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == 400


@pytest.mark.parametrize(
    "fields",
    [
        {"response_format": {"type": "json_schema"}},
        {"response_format": {"type": "xml"}},
        {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"},
        {"top_logprobs": 2},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        {"add_generation_prompt": True, "continue_final_message": True},
        {"max_completion_tokens": 5000},
    ],
    ids=[
        "json-schema-without-schema",
        "unknown-format",
        "tool-choice-auto",
        "top-logprobs-without-logprobs",
        "image-part",
        "both-generation-flags",
        "too-many-tokens",
    ],
)
def test_unsupported_chat_requests_are_400(http: httpx.Client, fields: dict) -> None:
    response = http.post("/v1/chat/completions", json={"messages": MESSAGES, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and error["message"]


def test_chat_prompt_too_long_is_400_before_streaming(http: httpx.Client) -> None:
    long = [{"role": "user", "content": "hello " * 1200}]
    for stream in (False, True):
        response = http.post("/v1/chat/completions", json={"messages": long, "stream": stream})
        assert response.status_code == 400
        message = response.json()["error"]["message"]
        assert "maximum context length is 1024 tokens" in message
