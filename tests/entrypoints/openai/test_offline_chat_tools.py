"""``LLM.chat(messages, tools=...)``: the tools and the calls of earlier turns reach the chat
template, and the default model's answer parses as a call with Kiln's Hermes parser."""

from __future__ import annotations

import json

import pytest
from tool_examples import FEW_SHOT, TEMPLATE, WEATHER

from kiln import LLM, SamplingParams
from kiln.entrypoints.openai.tool_parsers import resolve_tool_parser


def test_llm_chat_with_tools_calls_the_tool(llm_f32: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=60)
    (output,) = llm_f32.chat(
        FEW_SHOT, params, use_tqdm=False, tools=[WEATHER], chat_template=TEMPLATE.read_text()
    )
    prompt = output.prompt or ""
    assert json.dumps(WEATHER) in prompt  # the template got the tools
    assert '{"name": "get_weather", "arguments": {"city": "Rome"}}' in prompt  # as objects
    result = resolve_tool_parser("hermes")().extract_tool_calls(output.outputs[0].text)
    (call,) = result.tool_calls
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}


def test_llm_chat_tools_given_twice_is_an_error(llm_f32: LLM) -> None:
    with pytest.raises(ValueError, match="tools"):
        llm_f32.chat(FEW_SHOT[-1:], tools=[WEATHER], chat_template_kwargs={"tools": [WEATHER]})


def test_the_shipped_hermes_template_renders_an_agent_loop(llm_f32: LLM) -> None:
    """A developer turn, a call with null content, its result, a second round: the Hermes form
    the ``hermes`` parser reads, each turn once."""
    function = {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    call = {"id": "c1", "type": "function", "function": function}
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."},
        {"role": "user", "content": "Thanks"},
    ]
    text = llm_f32.get_tokenizer().apply_chat_template(
        messages, chat_template=TEMPLATE.read_text(), tools=[WEATHER]
    )
    assert text.startswith("<|im_start|>system\nBe brief.\nYou may call these functions")
    assert "developer" not in text and text.count("Be brief.") == 1
    turns = text.split("<|im_end|>\n")[1:]
    assert turns == [
        "<|im_start|>user\nWeather in Rome?",
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
        '"Rome"}}\n</tool_call>',
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>",
        "<|im_start|>assistant\nSunny.",
        "<|im_start|>user\nThanks",
        "<|im_start|>assistant\n",
    ]
