"""The messages a tool agent sends back, against a real ``kiln serve --enable-auto-tool-choice
--tool-call-parser hermes`` of the default model with its own chat template (SmolLM2's: it writes
``message['content']`` into a string and ignores tools), through the official ``openai`` client:
a two-step tool loop that sends the assistant turn back exactly as the SDK returns it
(``content=None``, ``tool_calls=[...]``), every message shape an agent sends, and 400s naming the
field for arguments that are not JSON and for content parts that are not text, after which the
server keeps serving."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from tool_examples import WEATHER

from kiln.testing.server import API_KEY, BASE_ARGS, KilnServer


@pytest.fixture(scope="module")
def agent_server(model_path: str) -> Iterator[KilnServer]:
    flags = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    kiln = KilnServer([*BASE_ARGS, "--api-key", API_KEY, *flags])
    yield kiln
    kiln.stop()


@pytest.fixture(scope="module")
def agent(agent_server: KilnServer) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{agent_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120
    )


def _chat(client: openai.OpenAI, messages: list[Any], **kwargs: Any) -> Any:
    model = client.models.list().data[0].id
    return client.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER], temperature=0, **kwargs
    )


# SmolLM2's template does not show the model the tools or earlier calls (it writes content only),
# so the examples of a call are the answers' text, which it then follows greedily.
EXAMPLE_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>'
QUESTION = [
    {"role": "system", "content": "Answer every question with a tool call."},
    {"role": "user", "content": "Weather in Rome?"},
    {"role": "assistant", "content": EXAMPLE_CALL % "Rome"},
    {"role": "user", "content": "Weather in Berlin?"},
    {"role": "assistant", "content": EXAMPLE_CALL % "Berlin"},
    {"role": "user", "content": "Weather in Paris?"},
]


def test_two_step_tool_loop_sends_the_sdk_message_back(agent: openai.OpenAI) -> None:
    # 1. Ask with tools: the model calls one (auto choice, parsed by the hermes parser).
    first = _chat(agent, QUESTION, max_tokens=40)
    (choice,) = first.choices
    assert choice.finish_reason == "tool_calls"
    message = choice.message
    assert message.content is None
    (call,) = message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # 2. The tool runs here; the assistant message goes back as the SDK gave it (the SDK sends
    # its "content": null), with the result under the call's id and the function's name.
    report = "22 C and sunny"
    result = {"role": "tool", "tool_call_id": call.id, "name": "get_weather", "content": report}
    second = _chat(agent, [*QUESTION, message, result], tool_choice="none", max_tokens=8)
    (answer,) = second.choices
    assert answer.message.content and not answer.message.tool_calls
    assert "22 C" in answer.message.content  # the model read the tool's answer
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
USER = {"role": "user", "content": "Weather in Paris?"}
SHAPES = {
    "content null": {"role": "assistant", "content": None, "tool_calls": [CALL]},
    "content missing": {"role": "assistant", "tool_calls": [CALL]},
    "arguments an object": {
        "role": "assistant",
        "tool_calls": [{**CALL, "function": {"name": "get_weather", "arguments": {"a": 1}}}],
    },
    "arguments missing": {
        "role": "assistant",
        "tool_calls": [{**CALL, "function": {"name": "get_weather"}}],
    },
    "arguments empty": {
        "role": "assistant",
        "tool_calls": [{**CALL, "function": {"name": "get_weather", "arguments": ""}}],
    },
    "text parts": {"role": "assistant", "content": [{"type": "text", "text": "Let me check."}]},
}
TOOL_RESULT = {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "22 C"}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_agent_message_shape_renders(agent: openai.OpenAI, shape: str) -> None:
    messages = [USER, SHAPES[shape], TOOL_RESULT]
    response = _chat(agent, messages, tool_choice="none", max_tokens=2)
    assert response.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    ("message", "field"),
    [
        (
            {
                "role": "assistant",
                "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{city: Paris}"}}],
            },
            "messages.1.tool_calls.0.function.arguments",
        ),
        (
            {
                "role": "assistant",
                "tool_calls": [{**CALL, "function": {"name": "f", "arguments": '"Paris"'}}],
            },
            "messages.1.tool_calls.0.function.arguments",
        ),
        (
            {
                "role": "assistant",
                "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "[" * 10**5}}],
            },
            "messages.1.tool_calls.0.function.arguments",  # nested too deeply to parse
        ),
        (
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
            "messages.1.content",
        ),
    ],
)
def test_bad_arguments_and_parts_are_400_naming_the_field(
    agent: openai.OpenAI, message: dict[str, Any], field: str
) -> None:
    messages = [USER, message]
    with pytest.raises(openai.BadRequestError) as info:
        _chat(agent, messages, tool_choice="none", max_tokens=2)
    body = info.value.body
    assert isinstance(body, dict) and body["param"] == field
    assert field in body["message"]
    # The server keeps serving.
    assert _chat(agent, [USER], tool_choice="none", max_tokens=2).choices
