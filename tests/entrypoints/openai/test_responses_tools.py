"""``/v1/responses`` with function tools and reasoning, against a real ``kiln serve
--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3`` with the shipped
Hermes template: ``function_call`` items equal to chat completions' calls for the same
conversation, a two-round tool loop through ``function_call`` / ``function_call_output`` items,
streamed call arguments, ``required`` / named / ``none`` choices, ``reasoning`` items, and the
OpenAI Agents SDK's default model (``OpenAIResponsesModel``) running a tool loop."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from tool_examples import FEW_SHOT, TEMPLATE, WEATHER

from kiln.testing.server import API_KEY, BASE_ARGS, KilnServer

# Responses' flat function tool.
WEATHER_TOOL = {"type": "function", **WEATHER["function"]}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(model_path: str) -> Iterator[KilnServer]:
    flags = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    flags += ["--reasoning-parser", "qwen3", "--chat-template", str(TEMPLATE)]
    # The default model never thinks on its own: a regex makes it (from the first token).
    flags += ["--structured-outputs-config", '{"enable_in_reasoning": true}']
    kiln = KilnServer([*BASE_ARGS, "--api-key", API_KEY, *flags])
    yield kiln
    kiln.stop()


@pytest.fixture(scope="module")
def client(server: KilnServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _items(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages as Responses input items (written out here, not by the server's code)."""
    items: list[dict[str, Any]] = []
    for message in messages:
        for call in message.get("tool_calls") or ():
            function = call["function"]
            items.append(
                {
                    "type": "function_call",
                    "call_id": call["id"],
                    "name": function["name"],
                    "arguments": function["arguments"],
                }
            )
        if message.get("content") is not None:
            items.append({"role": message["role"], "content": message["content"]})
    return items


def _ask(client: openai.OpenAI, model: str, **kwargs: Any) -> Any:
    return client.responses.create(
        model=model,
        input=_items(FEW_SHOT),
        tools=[WEATHER_TOOL],
        temperature=0,
        max_output_tokens=60,
        **kwargs,
    )


def test_auto_call_equals_chat_completions(client: openai.OpenAI, model: str) -> None:
    chat = client.chat.completions.create(
        model=model, messages=FEW_SHOT, tools=[WEATHER], temperature=0, max_tokens=60
    )
    (chat_call,) = chat.choices[0].message.tool_calls
    response = _ask(client, model)
    (call,) = response.output
    assert call.type == "function_call" and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id
    assert (call.name, call.arguments) == (chat_call.function.name, chat_call.function.arguments)
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.tool_choice == "auto" and response.tools[0].name == "get_weather"


def test_two_round_tool_loop(client: openai.OpenAI, model: str) -> None:
    first = _ask(client, model)
    (call,) = first.output
    reports = ["25 C and sunny", "-5 C and snowing"]
    for report in reports:
        items = [
            *_items(FEW_SHOT),
            {"type": "function_call", "call_id": call.call_id, "name": call.name,
             "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": report},
            {"role": "user", "content": "What did the weather tool answer?"},
        ]  # fmt: skip
        answer = client.responses.create(
            model=model,
            input=items,
            tools=[WEATHER_TOOL],
            tool_choice="none",
            temperature=0,
            max_output_tokens=20,
            # Held to one of the reports, so that the choice shows what the model read.
            extra_body={"structured_outputs": {"choice": reports}},
        )
        assert answer.output_text == report
        assert answer.usage.input_tokens > first.usage.input_tokens


def test_previous_response_id_carries_the_call(client: openai.OpenAI, model: str) -> None:
    first = _ask(client, model)
    (call,) = first.output
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "22 C"}
    follow = client.responses.create(
        model=model,
        previous_response_id=first.id,
        input=[output],
        tools=[WEATHER_TOOL],
        tool_choice="none",
        temperature=0,
        max_output_tokens=20,
    )
    spelled_out = {"type": "function_call", "call_id": call.call_id, "name": call.name}
    explicit = client.responses.create(
        model=model,
        input=[*_items(FEW_SHOT), {**spelled_out, "arguments": call.arguments}, output],
        tools=[WEATHER_TOOL],
        tool_choice="none",
        temperature=0,
        max_output_tokens=20,
    )
    assert follow.output_text == explicit.output_text
    assert follow.usage.input_tokens == explicit.usage.input_tokens


def test_streamed_call_arguments_reassemble(client: openai.OpenAI, model: str) -> None:
    (whole,) = _ask(client, model).output
    events = list(_ask(client, model, stream=True))
    types = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 1 and "".join(deltas) == whole.arguments
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == whole.arguments and done.name == "get_weather"
    added = events[types.index("response.output_item.added")]
    assert added.item.type == "function_call" and added.item.name == "get_weather"
    assert types.index("response.output_item.done") > types.index(
        "response.function_call_arguments.done"
    )
    assert types[-1] == "response.completed" and "response.output_text.delta" not in types
    (final,) = events[-1].response.output
    assert final.arguments == whole.arguments and final.id == added.item.id


def test_required_named_and_none_choices(client: openai.OpenAI, model: str) -> None:
    common = {"model": model, "input": QUESTION, "tools": [WEATHER_TOOL], "temperature": 0}
    required = client.responses.create(**common, tool_choice="required", max_output_tokens=60)
    kinds = {item.type for item in required.output}
    assert kinds == {"function_call"}, required.output  # one call or several, no text
    named = client.responses.create(
        **common, tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60
    )
    (call,) = named.output
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}
    none = client.responses.create(**common, tool_choice="none", max_output_tokens=8)
    assert [item.type for item in none.output] == ["message"]
    unknown = {"type": "function", "name": "get_time"}
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**common, tool_choice=unknown, max_output_tokens=8)
    assert info.value.body["param"] == "tool_choice"


def test_reasoning_items_whole_and_streamed(client: openai.OpenAI, model: str) -> None:
    regex = r"<think>[a-z ]{5,40}</think>[A-Z][a-z ]{5,40}\."
    kwargs = {"model": model, "input": QUESTION, "temperature": 0, "max_output_tokens": 60}
    kwargs["extra_body"] = {"structured_outputs": {"regex": regex}}
    response = client.responses.create(**kwargs)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    thought = reasoning.content[0].text
    assert thought and "think>" not in thought + response.output_text
    assert message.type == "message" and response.output_text
    events = list(client.responses.create(**kwargs, stream=True))
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (streamed, text) == (thought, response.output_text)
    assert [item.type for item in events[-1].response.output] == ["reasoning", "message"]


def test_an_openai_agents_sdk_responses_loop(server: KilnServer, model: str) -> None:
    """The Agents SDK's default model (``OpenAIResponsesModel``, on ``/v1/responses``): each run
    calls the tool (``required``, then the SDK's reset to ``auto``), sends the call and its output
    back as items, and ends with an answer; the second run sends the first back as history."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather of a city."""
        cities.append(city)
        return f"sunny in {city}"

    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    agent = Agent(
        name="weather",
        instructions="Call get_weather for the city the user names, then answer in one sentence.",
        model=OpenAIResponsesModel(model=model, openai_client=client),
        tools=[get_weather],
        model_settings=ModelSettings(temperature=0, max_tokens=60, tool_choice="required"),
    )

    async def two_runs() -> tuple[Any, Any]:
        first = await Runner.run(agent, "What is the weather in Paris?", max_turns=4)
        history = [*first.to_input_list(), {"role": "user", "content": "And in Rome?"}]
        return first, await Runner.run(agent, history, max_turns=4)

    first, second = asyncio.run(two_runs())
    assert "Paris" in cities and cities[-1] == "Rome", cities
    for result in (first, second):
        kinds = [type(item).__name__ for item in result.new_items]
        assert kinds[-1] == "MessageOutputItem" and "MessageOutputItem" not in kinds[:-1], kinds
        assert kinds.count("ToolCallItem") == kinds.count("ToolCallOutputItem") >= 1, kinds
        assert isinstance(result.final_output, str) and result.final_output


def test_raw_function_call_events_name_their_item(server: KilnServer, model: str) -> None:
    body = {"model": model, "input": _items(FEW_SHOT), "tools": [WEATHER_TOOL], "stream": True}
    body |= {"temperature": 0, "max_output_tokens": 60}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", f"{server.url}/v1/responses", json=body, headers=headers) as answer:
        data = [json.loads(line[6:]) for line in answer.iter_lines() if line.startswith("data: ")]
    (added,) = [e for e in data if e["type"] == "response.output_item.added"]
    item_id = added["item"]["id"]
    pieces = [e for e in data if e["type"].startswith("response.function_call_arguments")]
    assert pieces and all(e["item_id"] == item_id and e["output_index"] == 0 for e in pieces)
    assert [e["sequence_number"] for e in data] == list(range(len(data)))
