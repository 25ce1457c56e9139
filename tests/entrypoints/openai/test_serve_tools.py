"""Tool calling and reasoning output against real servers, through the official ``openai``
client: vLLM's 400s without the flags (on the shared server), and, on a server with
``--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3`` and a
Hermes-style template written for these tests, real calls by the default model: parsed, streamed
in OpenAI's pieces, and round-tripped through the template."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
from tool_examples import FEW_SHOT, TEMPLATE, WEATHER

from kiln.testing.server import API_KEY, BASE_ARGS, KilnServer


@pytest.fixture(scope="module")
def tool_server(model_path: str) -> Iterator[KilnServer]:
    flags = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    flags += ["--reasoning-parser", "qwen3", "--chat-template", str(TEMPLATE)]
    # The default model never thinks on its own: the tests force its thinking (and answers) with
    # structured outputs, which must then apply from the first token.
    flags += ["--structured-outputs-config", '{"enable_in_reasoning": true}']
    kiln = KilnServer([*BASE_ARGS, "--api-key", API_KEY, *flags])
    yield kiln
    kiln.stop()


Chat = Callable[..., Any]


@pytest.fixture(scope="module")
def chat(client: openai.OpenAI, model_name: str) -> Chat:
    """``chat.completions.create`` on the shared server (no tool flags)."""
    return functools.partial(client.chat.completions.create, model=model_name)


@pytest.fixture(scope="module")
def tool_chat(tool_server: KilnServer) -> Chat:
    """``chat.completions.create`` on the server with the tool and reasoning flags."""
    client = openai.OpenAI(
        base_url=f"{tool_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120
    )
    return functools.partial(client.chat.completions.create, model=client.models.list().data[0].id)


def _bad_request(chat: Chat, **kwargs: Any) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as info:
        chat(messages=FEW_SHOT[-1:], max_tokens=4, **kwargs)
    body = info.value.body
    assert isinstance(body, dict)
    return body


# -- without the flags (the shared server) -------------------------------------------------------


@pytest.mark.parametrize("choice", [{}, {"tool_choice": "auto"}])
def test_auto_without_flags_is_400_naming_them(chat: Chat, choice: dict) -> None:
    body = _bad_request(chat, tools=[WEATHER], **choice)
    assert "--enable-auto-tool-choice" in body["message"]
    assert "--tool-call-parser" in body["message"] and body["param"] == "tool_choice"


def test_empty_tools_is_400(chat: Chat) -> None:
    assert _bad_request(chat, tools=[])["param"] == "tools"
    assert _bad_request(chat, tools=[], tool_choice="none")["param"] == "tools"


def test_named_function_not_in_tools_is_400(chat: Chat) -> None:
    choice = {"type": "function", "function": {"name": "get_time"}}
    body = _bad_request(chat, tools=[WEATHER], tool_choice=choice)
    assert "does not match any of the specified `tools`" in body["message"]
    assert body["param"] == "tool_choice"


def test_tool_choice_without_tools_is_400(chat: Chat) -> None:
    body = _bad_request(chat, tool_choice="required")
    assert "`tools` must be set" in body["message"]


def test_hostile_tools_are_bounded(chat: Chat) -> None:
    many = [{**WEATHER, "function": {**WEATHER["function"], "name": f"f{i}"}} for i in range(129)]
    assert "at most 128 tools" in _bad_request(chat, tools=many, tool_choice="none")["message"]
    huge = {"type": "object", "description": "x" * 40_000}
    big = [{"type": "function", "function": {"name": "f", "parameters": huge}}]
    assert (
        "parameters must hold at most"
        in _bad_request(chat, tools=big, tool_choice="required")["message"]
    )


def test_tool_choice_none_answers_text(chat: Chat) -> None:
    response = chat(messages=FEW_SHOT[-1:], tools=[WEATHER], tool_choice="none", max_tokens=4)
    (choice,) = response.choices
    assert choice.message.tool_calls is None and choice.message.content


# -- with the flags --------------------------------------------------------------------------------


def _ask(chat: Chat, **kwargs: Any) -> Any:
    return chat(messages=FEW_SHOT, tools=[WEATHER], temperature=0, max_tokens=60, **kwargs)


def test_auto_tool_call_is_parsed(tool_chat: Chat) -> None:
    (choice,) = _ask(tool_chat).choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_streamed_tool_call_deltas_reassemble_to_the_call(tool_chat: Chat) -> None:
    (whole,) = _ask(tool_chat).choices
    chunks = list(_ask(tool_chat, stream=True))
    calls: dict[int, dict[str, Any]] = {}
    num_argument_pieces = 0
    for chunk in chunks:
        for piece in chunk.choices[0].delta.tool_calls or ():
            if piece.index not in calls:  # the first piece: id, type and name
                assert piece.id and piece.type == "function" and piece.function.name
                calls[piece.index] = {"name": piece.function.name, "arguments": ""}
            else:
                assert piece.id is None and piece.function.name is None
                num_argument_pieces += 1
            calls[piece.index]["arguments"] += piece.function.arguments or ""
    assert num_argument_pieces > 1  # arguments arrive in fragments
    expected = [
        {"name": c.function.name, "arguments": c.function.arguments}
        for c in whole.message.tool_calls
    ]
    assert [calls[i] for i in sorted(calls)] == expected
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    assert finishes == ["tool_calls"]


def test_tool_round_trip_through_the_template(tool_chat: Chat, tool_server: KilnServer) -> None:
    (choice,) = _ask(tool_chat).choices
    (call,) = choice.message.tool_calls
    result = {"role": "tool", "tool_call_id": call.id, "content": "22 C and sunny"}
    messages = [*FEW_SHOT, choice.message.model_dump(exclude_none=True), result]
    answer = tool_chat(messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=20)
    assert answer.choices[0].message.content
    # What the template received: the call's arguments as an object, the tool's answer.
    headers = {"Authorization": f"Bearer {API_KEY}"}
    tokens = httpx.post(
        f"{tool_server.url}/tokenize", json={"messages": messages}, headers=headers
    ).json()["tokens"]
    text = httpx.post(
        f"{tool_server.url}/detokenize", json={"tokens": tokens}, headers=headers
    ).json()["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<tool_response>\n22 C and sunny\n</tool_response>" in text


def test_full_tool_round_trip_through_the_model(tool_chat: Chat) -> None:
    # 1. The model calls the tool.
    first = _ask(tool_chat)
    (call,) = first.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assistant = first.choices[0].message.model_dump(exclude_none=True)
    reports = ["25 C and sunny", "-5 C and snowing"]

    def final_answer(report: str) -> Any:
        # 2. The tool runs here; 3. its result goes back under the call's id, and the model
        # answers, held to one of the two reports so that its choice shows what it read.
        result = {"role": "tool", "tool_call_id": call.id, "content": report}
        question = {"role": "user", "content": "What did the weather tool answer?"}
        return tool_chat(
            messages=[*FEW_SHOT, assistant, result, question],
            tools=[WEATHER],
            tool_choice="none",
            temperature=0,
            max_tokens=20,  # room for either report spelt a character a token
            extra_body={"structured_outputs": {"choice": reports}},
        )

    for report in reports:
        answer = final_answer(report)
        (choice,) = answer.choices
        assert choice.finish_reason == "stop" and not choice.message.tool_calls
        # The answer is what the tool returned: the template gave the model the tool turn.
        assert choice.message.content == report
        assert answer.usage.prompt_tokens > first.usage.prompt_tokens


def test_reasoning_parser_leaves_an_answer_without_thinking_as_content(
    tool_chat: Chat,
) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    response = tool_chat(messages=messages, temperature=0, max_tokens=12)
    message = response.choices[0].message.model_dump()
    assert message["content"] and message["reasoning_content"] is None


# -- required and named: enforced by structured outputs, no flag needed (the shared server) -------

TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The current time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
        },
    },
}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def _calls(message: Any) -> list[tuple[str, Any]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


def _check_arguments(name: str, arguments: Any) -> None:
    """The arguments validate against the tool's schema (written out here, not from the code)."""
    if name == "get_weather":
        assert set(arguments) == {"city"} and isinstance(arguments["city"], str)
    else:
        assert name == "get_time" and arguments in ({"zone": "UTC"}, {"zone": "CET"})


@pytest.mark.parametrize("parallel", [None, False])
def test_required_choice_always_parses(chat: Chat, parallel: bool | None) -> None:
    (choice,) = chat(
        messages=QUESTION,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=parallel,
        temperature=0,
        max_tokens=120,
    ).choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = _calls(choice.message)
    assert calls and (parallel is None or len(calls) == 1)
    for name, arguments in calls:
        _check_arguments(name, arguments)


def test_named_choice_always_parses(chat: Chat) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    for seed in range(3):  # sampled, not greedy: the constraint holds whatever is drawn
        (choice,) = chat(
            messages=QUESTION,
            tools=[WEATHER, TIME],
            tool_choice=named,
            temperature=1.0,
            seed=seed,
            max_tokens=60,
        ).choices
        (call,) = _calls(choice.message)
        _check_arguments(*call)
        assert choice.finish_reason == "stop"  # as OpenAI answers a forced function


def test_required_streamed_deltas_reassemble(chat: Chat) -> None:
    kwargs = {"messages": QUESTION, "tools": [WEATHER, TIME], "tool_choice": "required"}
    kwargs |= {"temperature": 0, "max_tokens": 120}
    (whole,) = chat(**kwargs).choices
    calls: dict[int, list[str]] = {}
    for chunk in chat(**kwargs, stream=True):
        for piece in chunk.choices[0].delta.tool_calls or ():
            if piece.id is not None:
                calls[piece.index] = [piece.function.name, ""]
            calls[piece.index][1] += piece.function.arguments or ""
    expected = [[c.function.name, c.function.arguments] for c in whole.message.tool_calls]
    assert [calls[i] for i in sorted(calls)] == expected


def test_reasoning_split_whole_and_streamed(tool_chat: Chat) -> None:
    # A regex makes the default model think in Qwen3's tags (it never does on its own).
    regex = r"<think>[a-z ]{5,40}</think>[A-Z][a-z ]{5,40}\."
    kwargs = {"messages": QUESTION, "temperature": 0, "max_tokens": 60}
    kwargs["extra_body"] = {"structured_outputs": {"regex": regex}}
    message = tool_chat(**kwargs).choices[0].message.model_dump()
    assert message["reasoning_content"] and message["content"]
    assert "think>" not in message["reasoning_content"] + message["content"]
    reasoning = content = ""
    for chunk in tool_chat(**kwargs, stream=True):
        delta = chunk.choices[0].delta.model_dump()
        reasoning += delta.get("reasoning_content") or ""
        content += delta.get("content") or ""
    assert (reasoning, content) == (message["reasoning_content"], message["content"])


# -- a real agent framework ------------------------------------------------------------------------


def test_an_openai_agents_sdk_loop_runs_two_tool_rounds(tool_server: KilnServer) -> None:
    """The OpenAI Agents SDK's chat-completions model against the tool server: each run calls the
    tool (``required`` on its first turn, then the SDK's reset to ``auto``, with which the model
    may call again), sends each call and its result back, and ends with an answer; the second
    run sends the whole first run back as history (an assistant turn with ``content: null`` and
    ``tool_calls``, a ``tool`` turn): the step every multi-step agent took before it failed with
    a 400."""
    import asyncio

    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
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

    client = openai.AsyncOpenAI(base_url=f"{tool_server.url}/v1", api_key=API_KEY, max_retries=0)
    name = httpx.get(
        f"{tool_server.url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}
    ).json()["data"][0]["id"]
    agent = Agent(
        name="weather",
        instructions="Call get_weather for the city the user names, then answer in one sentence.",
        model=OpenAIChatCompletionsModel(model=name, openai_client=client),
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
        # Calls (one or several at a time) and as many results, then the answer.
        assert kinds[-1] == "MessageOutputItem" and "MessageOutputItem" not in kinds[:-1], kinds
        assert kinds.count("ToolCallItem") == kinds.count("ToolCallOutputItem") >= 1, kinds
        assert isinstance(result.final_output, str) and result.final_output
