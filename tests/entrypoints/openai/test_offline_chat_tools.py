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
