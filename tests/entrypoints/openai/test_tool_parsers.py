"""Tool and reasoning parsers on hand-written model text: whole and streamed forms, complete,
partial, malformed, several calls, text before a call; the registries plugins extend."""

from __future__ import annotations

import json

import pytest

from kiln.engine.detokenizer import IncrementalDetokenizer
from kiln.entrypoints.openai.tool_parsers import (
    TOOL_PARSER_REGISTRY,
    DeltaMessage,
    ToolParser,
    ToolParserOptions,
    resolve_tool_parser,
)
from kiln.entrypoints.openai.tool_parsers.json_scan import DEFAULT_MAX_DEPTH
from kiln.entrypoints.openai.tool_parsers.llama3_json import RequiredCallsParser
from kiln.plugins.registry import registering_as
from kiln.reasoning import (
    REASONING_PARSER_REGISTRY,
    ReasoningParser,
    resolve_reasoning_parser,
)
from kiln.sampling_params import SamplingParams
from kiln.tokenizer import Tokenizer, load_tokenizer

HERMES_TWO_CALLS = (
    "Let me look that up.\n"
    "<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
    "</tool_call>\n"
    "<tool_call>\n"
    '{"name": "get_time", "arguments": {"zone": "Europe/Paris", "note": "a } and a \\" inside"}}\n'
    "</tool_call>"
)


def stream(parser: ToolParser, text: str, size: int) -> DeltaMessage:
    """``text`` fed in pieces of ``size`` characters; the deltas merged, with the number of first
    pieces (those with an id) checked to be one per call."""
    merged = DeltaMessage()
    firsts = 0
    for start in range(0, len(text), size):
        delta = parser.extract_tool_calls_streaming(text[start : start + size])
        firsts += sum(piece.id is not None for piece in delta.tool_calls)
        merged.extend(delta)
    merged.extend(parser.finish())
    assert firsts == len(merged.tool_calls)
    return merged


def test_hermes_whole_text_two_calls_and_content() -> None:
    result = resolve_tool_parser("hermes")().extract_tool_calls(HERMES_TWO_CALLS)
    assert result.content == "Let me look that up."
    assert [call.name for call in result.tool_calls] == ["get_weather", "get_time"]
    assert json.loads(result.tool_calls[0].arguments) == {"city": "Paris", "unit": "celsius"}
    assert json.loads(result.tool_calls[1].arguments) == {
        "zone": "Europe/Paris",
        "note": 'a } and a " inside',
    }
    assert all(call.id.startswith("chatcmpl-tool-") for call in result.tool_calls)
    assert len({call.id for call in result.tool_calls}) == 2


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_hermes_streamed_pieces_reassemble_to_whole(size: int) -> None:
    cls = resolve_tool_parser("hermes")
    whole = cls().extract_tool_calls(HERMES_TWO_CALLS)
    streamed = stream(cls(), HERMES_TWO_CALLS, size)
    assert streamed.content == whole.content
    assert [(p.index, p.name, p.arguments) for p in streamed.tool_calls] == [
        (i, c.name, c.arguments) for i, c in enumerate(whole.tool_calls)
    ]


def test_hermes_first_piece_has_id_and_name_then_argument_fragments() -> None:
    parser = resolve_tool_parser("hermes")()
    pieces = []
    for char in HERMES_TWO_CALLS:
        pieces += parser.extract_tool_calls_streaming(char).tool_calls
    first = [p for p in pieces if p.index == 0]
    assert first[0].id is not None and first[0].name == "get_weather"
    assert all(p.id is None and p.name is None for p in first[1:])
    assert len(first) > 5  # the arguments arrive in fragments, not at the end
    assert first[0].to_dict() == {
        "index": 0,
        "id": first[0].id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": first[0].arguments},
    }
    assert first[1].to_dict() == {"index": 0, "function": {"arguments": first[1].arguments}}


def test_hermes_plain_text_is_content_unchanged() -> None:
    text = "The capital of France is Paris.  \n"
    parser = resolve_tool_parser("hermes")()
    assert parser.extract_tool_calls(text).content == text
    assert not parser.extract_tool_calls(text).tools_called
    assert stream(parser, text, 1).content == text


def test_hermes_partial_tag_is_held_then_given_back() -> None:
    parser = resolve_tool_parser("hermes")()
    assert parser.extract_tool_calls_streaming("Sure <tool_c").content == "Sure"
    assert parser.finish().content == " <tool_c"


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>\nnot json\n</tool_call>",
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}',  # cut off
        '<tool_call>\n{"name": "f", "arguments": [1, 2]}\n</tool_call>',  # not an object
    ],
)
def test_hermes_malformed_call_is_content(text: str) -> None:
    result = resolve_tool_parser("hermes")().extract_tool_calls(text)
    assert not result.tools_called and result.content == text


def test_hermes_arguments_given_as_json_text_and_late_name() -> None:
    text = '<tool_call>{"arguments": "{\\"q\\": 1}", "name": "search"}</tool_call>'
    (call,) = resolve_tool_parser("hermes")().extract_tool_calls(text).tool_calls
    assert call.name == "search" and json.loads(call.arguments) == {"q": 1}


def test_parallel_cap_drops_later_calls() -> None:
    parser = resolve_tool_parser("hermes")(ToolParserOptions(max_calls=1))
    result = parser.extract_tool_calls(HERMES_TWO_CALLS)
    assert [call.name for call in result.tool_calls] == ["get_weather"]


def test_call_size_cap_makes_a_call_malformed() -> None:
    text = '<tool_call>{"name": "f", "arguments": {"a": "' + "x" * 200 + '"}}</tool_call>'
    parser = resolve_tool_parser("hermes")(ToolParserOptions(max_call_chars=100))
    assert not parser.extract_tool_calls(text).tools_called
    assert resolve_tool_parser("hermes")().extract_tool_calls(text).tools_called


LLAMA_TWO_CALLS = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris; France"}}; '
    '{"name": "get_time", "parameters": {}}'
)


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_llama3_json_calls_whole_and_streamed(size: int) -> None:
    cls = resolve_tool_parser("llama3_json")
    whole = cls().extract_tool_calls(LLAMA_TWO_CALLS)
    assert whole.content is None
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == [
        ("get_weather", {"city": "Paris; France"}),
        ("get_time", {}),
    ]
    streamed = stream(cls(), LLAMA_TWO_CALLS, size)
    assert [p.arguments for p in streamed.tool_calls] == [c.arguments for c in whole.tool_calls]


def test_llama3_json_text_first_is_content() -> None:
    text = 'I would call {"name": "f", "parameters": {}}'
    result = resolve_tool_parser("llama3_json")().extract_tool_calls(text)
    assert not result.tools_called and result.content == text


def test_required_array_form() -> None:
    text = ' [{"name": "a", "parameters": {"x": [1, {"y": "]"}]}}, {"name": "b", "parameters": {}}]'
    result = RequiredCallsParser().extract_tool_calls(text)
    assert [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == [
        ("a", {"x": [1, {"y": "]"}]}),
        ("b", {}),
    ]
    streamed = stream(RequiredCallsParser(), text, 2)
    assert [p.arguments for p in streamed.tool_calls] == [c.arguments for c in result.tool_calls]


QWEN3_TEXT = "<think>\nThe user wants 2+2. That is 4.\n</think>\n\nThe answer is 4."


def test_qwen3_reasoning_whole() -> None:
    parser = resolve_reasoning_parser("qwen3")()
    assert parser.extract_reasoning(QWEN3_TEXT) == (
        "\nThe user wants 2+2. That is 4.\n",
        "\n\nThe answer is 4.",
    )
    assert parser.extract_reasoning("No thinking here.") == (None, "No thinking here.")
    assert parser.extract_reasoning("<think>cut off mid-thou") == ("cut off mid-thou", None)


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_qwen3_reasoning_streamed_matches_whole(size: int) -> None:
    parser = resolve_reasoning_parser("qwen3")()
    reasoning = content = ""
    for start in range(0, len(QWEN3_TEXT), size):
        r, c = parser.extract_reasoning_streaming(QWEN3_TEXT[start : start + size])
        reasoning, content = reasoning + r, content + c
    r, c = parser.finish()
    assert (reasoning + r, content + c) == parser.extract_reasoning(QWEN3_TEXT)
    assert "think>" not in reasoning + content


class _PluginToolParser(ToolParser):
    """A plugin's parser: every answer is one call to ``echo``."""

    def __init__(self, options: ToolParserOptions | None = None) -> None:
        super().__init__(options)

    def extract_tool_calls_streaming(self, delta_text: str) -> DeltaMessage:
        return DeltaMessage(content=delta_text)

    def finish(self) -> DeltaMessage:
        return DeltaMessage()


def test_plugins_register_parsers_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    # The registries as they are now come back after the test.
    for registry in (TOOL_PARSER_REGISTRY, REASONING_PARSER_REGISTRY):
        monkeypatch.setattr(registry, "_entries", dict(registry._entries))
    name = "test_plugin_echo"
    with registering_as("test-plugin"):
        TOOL_PARSER_REGISTRY.register(name, f"{__name__}._PluginToolParser")
        REASONING_PARSER_REGISTRY.register(name, "kiln.reasoning.Qwen3ReasoningParser")
    assert resolve_tool_parser(name) is _PluginToolParser
    assert issubclass(resolve_reasoning_parser(name), ReasoningParser)
    assert TOOL_PARSER_REGISTRY.source_of(name) == "test-plugin"
    with pytest.raises(ValueError, match="already registered"):
        TOOL_PARSER_REGISTRY.register("hermes", f"{__name__}._PluginToolParser")
    TOOL_PARSER_REGISTRY.register("not_a_parser", "json.dumps")
    with pytest.raises(ValueError, match="not a subclass"):
        resolve_tool_parser("not_a_parser")
    with pytest.raises(ValueError, match=r"registered: \[.*'hermes'"):
        resolve_tool_parser("nope")


DEEP = 1100
"""Nesting past Python's recursion limit: ``json.loads`` of it raises ``RecursionError``."""


@pytest.fixture(scope="module")
def tokenizer(gguf_path: str) -> Tokenizer:
    return load_tokenizer(gguf_path)


def stream_tokens(parser: ToolParser, tokenizer: Tokenizer, text: str) -> DeltaMessage:
    """``text`` as the default model's tokens, detokenized one by one as the server streams."""
    detokenizer = IncrementalDetokenizer(tokenizer, SamplingParams())
    merged = DeltaMessage()
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    for i, token_id in enumerate(token_ids):
        detokenizer.update([token_id], finished=i == len(token_ids) - 1)
        delta = detokenizer.get_next_output_text(finished=False, delta=True)
        merged.extend(parser.extract_tool_calls_streaming(delta))
    merged.extend(parser.finish())
    return merged


@pytest.mark.parametrize(
    "call",
    [
        '{"name": "f", "arguments": ' + '{"a": ' * DEEP + "1" + "}" * DEEP + "}",
        '{"name": ' + "[" * DEEP + "]" * DEEP + ', "arguments": {}}',
        '{"name": "f", "arguments": "' + "[" * DEEP + "]" * DEEP + '"}',  # as JSON text
        '{"name": "f", "arguments": "\\x"}',  # an escape JSON does not have
    ],
    ids=["deep-arguments", "deep-name", "deep-arguments-text", "bad-escape"],
)
def test_hermes_call_that_does_not_parse_is_content(tokenizer: Tokenizer, call: str) -> None:
    """Issue 26 item 5: a call too deep for ``json.loads`` raised ``RecursionError`` (a 500 after
    the whole generation). Whole: the text is content; streamed token by token: no error, and no
    complete call (a call whose name was streamed cannot be taken back: the rest is dropped)."""
    text = f"Sure.<tool_call>\n{call}\n</tool_call>"
    result = resolve_tool_parser("hermes")().extract_tool_calls(text)
    assert not result.tools_called and result.content == text
    merged = stream_tokens(resolve_tool_parser("hermes")(), tokenizer, text)
    if merged.tool_calls:
        assert not any(_parses(piece.arguments) for piece in merged.tool_calls)
    else:
        assert merged.content == text


def _parses(arguments: str) -> bool:
    try:
        json.loads(arguments)
    except (ValueError, RecursionError):
        return False
    return True


def test_hermes_nesting_within_the_bound_is_a_call(tokenizer: Tokenizer) -> None:
    depth = DEFAULT_MAX_DEPTH
    arguments = '{"a": ' * (depth - 1) + "[1]" + "}" * (depth - 1)
    text = '<tool_call>{"name": "f", "arguments": ' + arguments + "}</tool_call>"
    (call,) = resolve_tool_parser("hermes")().extract_tool_calls(text).tool_calls
    assert call.arguments == arguments
    (piece,) = stream_tokens(resolve_tool_parser("hermes")(), tokenizer, text).tool_calls
    assert piece.arguments == arguments
    deeper = text.replace("[1]", "[[1]]")
    assert not resolve_tool_parser("hermes")().extract_tool_calls(deeper).tools_called
