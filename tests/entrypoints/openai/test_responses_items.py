"""The Responses -> chat mapping on its own (no server): input items to chat messages, flat tools
and choices to chat's, a chat message to output items. Expected values are written out here."""

from __future__ import annotations

import pytest

from kiln.entrypoints.openai.errors import OpenAIError
from kiln.entrypoints.openai.responses_items import (
    output_items,
    to_chat_tool_choice,
    to_chat_tools,
    to_messages,
    to_response_format,
)


def test_items_become_chat_turns() -> None:
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "Weather in Paris"},
            {"type": "input_text", "text": "and Rome?"},
        ]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": "Checking.", "annotations": []},
        ]},
        {"type": "function_call", "call_id": "c1", "name": "w", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "w", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "rain"}]},
    ]  # fmt: skip
    call = {"type": "function", "function": {"name": "w"}}
    assert to_messages(items, "You help.") == [
        {"role": "system", "content": "You help."},
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris\nand Rome?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {"id": "c1", **call, "function": {"name": "w", "arguments": '{"city": "Paris"}'}},
                {"id": "c2", **call, "function": {"name": "w", "arguments": '{"city": "Rome"}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
    ]


def test_a_call_after_a_user_turn_opens_an_assistant_turn() -> None:
    items = [
        {"role": "user", "content": "hi"},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": ""},
    ]
    assert to_messages(items, None)[1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ],
    }


def test_tools_choices_and_formats_in_chat_shape() -> None:
    tool = {"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"}}
    assert to_chat_tools([{**tool, "strict": None}]) == [
        {"type": "function", "function": {"name": "f", "description": "d",
                                          "parameters": {"type": "object"}}}
    ]  # fmt: skip
    assert to_chat_tool_choice({"type": "function", "name": "f"}) == {
        "type": "function",
        "function": {"name": "f"},
    }
    assert to_chat_tool_choice("required") == "required"
    form = {"type": "json_schema", "name": "n", "schema": {"type": "object"}, "strict": True}
    assert to_response_format({"format": form}) == {
        "type": "json_schema",
        "json_schema": {"name": "n", "schema": {"type": "object"}, "strict": True},
    }
    assert to_response_format({"format": {"type": "text"}}) == {"type": "text"}
    with pytest.raises(OpenAIError) as info:
        to_chat_tool_choice({"type": "file_search"})
    assert info.value.param == "tool_choice"


def test_a_chat_message_becomes_output_items() -> None:
    message = {
        "role": "assistant",
        "content": "Let me look.",
        "reasoning_content": "they want weather",
        "tool_calls": [
            {"id": "call_9", "type": "function", "function": {"name": "w", "arguments": "{}"}}
        ],
    }
    reasoning, text, call = output_items(message, "completed")
    assert reasoning["type"] == "reasoning"
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "they want weather"}]
    assert text["type"] == "message" and text["content"][0]["text"] == "Let me look."
    assert (call["type"], call["call_id"], call["name"], call["arguments"]) == (
        "function_call",
        "call_9",
        "w",
        "{}",
    )
    assert reasoning["id"].startswith("rs_") and call["id"].startswith("fc_")
    # Calls alone: no empty message item; nothing at all: an empty message.
    only_calls = output_items({**message, "content": None, "reasoning_content": None}, "completed")
    assert [item["type"] for item in only_calls] == ["function_call"]
    assert [i["type"] for i in output_items({"content": ""}, "completed")] == ["message"]
