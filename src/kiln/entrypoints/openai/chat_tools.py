"""Tool calling and reasoning output for the chat route, as vLLM serves them.

- ``plan_tools``: what a request's ``tools`` and ``tool_choice`` ask for, checked with vLLM's
  rules (``auto``, or tools without a choice, needs ``--enable-auto-tool-choice`` and
  ``--tool-call-parser``; a named function must be one of the tools; ``tools: []`` is refused),
  bounded against hostile input, and the structured output that makes ``required`` and a named
  function always parse.
- ``ChoiceParser``: one choice's text -> ``reasoning_content`` (with ``--reasoning-parser``),
  ``content`` and ``tool_calls``, streamed or whole. Tool calls are parsed in the answer part
  only (after the reasoning).

What it must not know: HTTP (errors are ``OpenAIError``), the engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kiln.entrypoints.openai.errors import OpenAIError
from kiln.entrypoints.openai.protocol import ChatCompletionRequest
from kiln.entrypoints.openai.tool_parsers import (
    DeltaMessage,
    DeltaToolCall,
    ToolCall,
    ToolParser,
    ToolParserOptions,
    resolve_tool_parser,
)
from kiln.entrypoints.openai.tool_parsers.base import ExtractedToolCalls, make_tool_call_id
from kiln.entrypoints.openai.tool_parsers.llama3_json import RequiredCallsParser
from kiln.reasoning import ReasoningParser, resolve_reasoning_parser
from kiln.sampling_params import MAX_STRUCTURED_OUTPUT_CHARS, StructuredOutputsParams

MAX_TOOLS = 128
"""The most tools one request may offer (OpenAI's cap)."""
MAX_TOOL_PARAMETERS_CHARS = 2**15
"""The most characters one tool's ``parameters`` schema may hold as JSON."""
MAX_TOOLS_CHARS = MAX_STRUCTURED_OUTPUT_CHARS
"""The most characters all tools together may hold as JSON (so ``required`` always compiles
within the structured-output cap)."""
AUTO_NEEDS_FLAGS = (
    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
)
_WHITESPACE = " \t\n\r"


@dataclass(frozen=True)
class ToolServerOptions:
    """The operator's tool and reasoning flags, with their parser classes resolved."""

    enable_auto_tool_choice: bool = False
    tool_parser: type[ToolParser] | None = None
    reasoning_parser: type[ReasoningParser] | None = None


def resolve_server_options(
    enable_auto_tool_choice: bool, tool_call_parser: str | None, reasoning_parser: str | None
) -> ToolServerOptions:
    """The flags checked and resolved (at start-up, after general plugins registered theirs).

    Raises:
        ValueError: ``--enable-auto-tool-choice`` without ``--tool-call-parser``, or a parser
            name that is not registered.
    """
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
    return ToolServerOptions(
        enable_auto_tool_choice,
        resolve_tool_parser(tool_call_parser) if tool_call_parser else None,
        resolve_reasoning_parser(reasoning_parser) if reasoning_parser else None,
    )


@dataclass(frozen=True)
class ToolPlan:
    """What a request asks of tools."""

    choice: str = "none"
    """``none``, ``auto``, ``required`` or ``named``."""
    named: str | None = None
    """The function of a named choice."""
    tool_names: tuple[str, ...] = ()
    max_calls: int = 128
    structured_outputs: StructuredOutputsParams | None = None
    """What enforces ``required`` and a named choice."""


def plan_tools(request: ChatCompletionRequest, options: ToolServerOptions) -> ToolPlan:
    """Check the request's tools and choice (vLLM's rules, then the bounds).

    Raises:
        OpenAIError: 400 naming ``tools`` or ``tool_choice``.
    """
    tools = request.tools
    if tools is not None and not tools:
        raise OpenAIError(
            "`tools` must hold at least one tool; leave it out to call none", param="tools"
        )
    _check_bounds(request)  # tools reach the chat template whatever the choice
    choice = request.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return ToolPlan()
    if tools is None:
        raise OpenAIError("When using `tool_choice`, `tools` must be set.", param="tool_choice")
    names = tuple(tool.function.name for tool in tools)
    max_calls = 1 if request.parallel_tool_calls is False else MAX_TOOLS
    if choice == "auto":
        if not (options.enable_auto_tool_choice and options.tool_parser is not None):
            raise OpenAIError(AUTO_NEEDS_FLAGS, param="tool_choice")
        return ToolPlan("auto", None, names, max_calls)
    _check_no_other_constraint(request)
    if choice == "required":
        schema = _required_schema(request, max_calls)
        return ToolPlan("required", None, names, max_calls, _structured(schema))
    name = choice.function.name
    tool = next((t for t in tools if t.function.name == name), None)
    if tool is None:
        raise OpenAIError(
            "The tool specified in `tool_choice` does not match any of the specified `tools`",
            param="tool_choice",
        )
    schema = tool.function.parameters or {"type": "object", "properties": {}}
    return ToolPlan("named", name, names, 1, _structured(schema))


def _check_bounds(request: ChatCompletionRequest) -> None:
    tools = request.tools or []
    if len(tools) > MAX_TOOLS:
        raise OpenAIError(
            f"`tools` may hold at most {MAX_TOOLS} tools, got {len(tools)}", param="tools"
        )
    total = 0
    for index, tool in enumerate(tools):
        size = len(json.dumps(tool.function.parameters or {}))
        if size > MAX_TOOL_PARAMETERS_CHARS:
            raise OpenAIError(
                f"tools[{index}].function.parameters must hold at most "
                f"{MAX_TOOL_PARAMETERS_CHARS} characters as JSON, got {size}",
                param="tools",
            )
        total += size + len(tool.function.name)
    if total > MAX_TOOLS_CHARS:
        raise OpenAIError(
            f"`tools` must hold at most {MAX_TOOLS_CHARS} characters of names and parameters "
            f"together, got {total}",
            param="tools",
        )


def _check_no_other_constraint(request: ChatCompletionRequest) -> None:
    response_format = request.response_format
    constrained = response_format is not None and response_format.type != "text"
    if constrained or getattr(request, "structured_outputs", None) is not None:
        raise OpenAIError(
            "You can only either use constraints for structured outputs or tools, not both.",
            param="tool_choice",
        )


def _required_schema(request: ChatCompletionRequest, max_calls: int) -> dict[str, Any]:
    """A JSON array of ``{"name", "parameters"}``, one of the tools each, at least one call.
    The tools' ``$defs`` move to the top so that their ``$ref`` s still resolve."""
    defs: dict[str, Any] = {}
    options = []
    for tool in request.tools or []:
        parameters = dict(tool.function.parameters or {"type": "object", "properties": {}})
        for def_name, definition in parameters.pop("$defs", {}).items():
            if defs.get(def_name, definition) != definition:
                raise OpenAIError(
                    f"two tools define `$defs` {def_name!r} differently; tool_choice "
                    "'required' needs one meaning per name",
                    param="tools",
                )
            defs[def_name] = definition
        options.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": options}}
    if max_calls == 1:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _structured(schema: dict[str, Any]) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(json=schema)
    except ValueError as exc:
        raise OpenAIError(str(exc), param="tools") from None


class NamedCallParser(ToolParser):
    """The answer to a named ``tool_choice``: the whole (constrained) answer is the arguments of
    that one function."""

    def __init__(self, options: ToolParserOptions | None = None) -> None:
        super().__init__(options)
        self.name = self.options.tool_names[0] if self.options.tool_names else ""
        self.is_started = False
        self.held_ws = ""

    def extract_tool_calls_streaming(self, delta_text: str) -> DeltaMessage:
        text = self.held_ws + delta_text
        if not self.is_started:
            text = text.lstrip(_WHITESPACE)
        kept = text.rstrip(_WHITESPACE)
        self.held_ws = text[len(kept) :]
        if not self.is_started:
            self.is_started = True
            piece = DeltaToolCall(0, make_tool_call_id(), self.name, kept)
            return DeltaMessage(tool_calls=[piece])
        return DeltaMessage(tool_calls=[DeltaToolCall(0, arguments=kept)] if kept else [])

    def finish(self) -> DeltaMessage:
        if not self.is_started:
            return self.extract_tool_calls_streaming("")
        return DeltaMessage()

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        return ExtractedToolCalls([ToolCall(self.name, text.strip(_WHITESPACE))], None)


@dataclass
class ChoiceDelta:
    """What one text delta of a choice streams."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[DeltaToolCall] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The chunk's ``delta`` (only the keys with something to say)."""
        delta: dict[str, Any] = {}
        if self.reasoning:
            delta["reasoning_content"] = self.reasoning
        if self.content:
            delta["content"] = self.content
        if self.tool_calls:
            delta["tool_calls"] = [piece.to_dict() for piece in self.tool_calls]
        return delta


class ChoiceParser:
    """One choice's text through the reasoning parser, then (on the answer part) the tool
    parser the plan calls for."""

    def __init__(self, plan: ToolPlan, options: ToolServerOptions) -> None:
        self.plan = plan
        reasoning_cls = options.reasoning_parser
        self.reasoning = reasoning_cls() if reasoning_cls is not None else None
        parser_options = ToolParserOptions(
            tool_names=(plan.named,) if plan.named else plan.tool_names, max_calls=plan.max_calls
        )
        parser_cls: type[ToolParser] | None = {
            "auto": options.tool_parser,
            "required": RequiredCallsParser,
            "named": NamedCallParser,
        }.get(plan.choice)
        self.tools = parser_cls(parser_options) if parser_cls is not None else None
        self.num_calls = 0

    @property
    def has_reasoning(self) -> bool:
        return self.reasoning is not None

    def feed(self, text: str) -> ChoiceDelta:
        """The delta to stream for the next ``text`` of the choice."""
        if self.reasoning is None:
            return self._answer("", text)
        reasoning, content = self.reasoning.extract_reasoning_streaming(text)
        return self._answer(reasoning, content)

    def finish(self) -> ChoiceDelta:
        """What the parsers held back, at the end of the choice."""
        reasoning, content = "", ""
        if self.reasoning is not None:
            reasoning, content = self.reasoning.finish()
        delta = self._answer(reasoning, content)
        if self.tools is not None:
            tail = self.tools.finish()
            delta.content += tail.content
            delta.tool_calls += tail.tool_calls
            self._count(tail)
        return delta

    def _answer(self, reasoning: str, content: str) -> ChoiceDelta:
        if self.tools is None or not content:
            return ChoiceDelta(reasoning, content)
        message = self.tools.extract_tool_calls_streaming(content)
        self._count(message)
        return ChoiceDelta(reasoning, message.content, message.tool_calls)

    def _count(self, message: DeltaMessage) -> None:
        self.num_calls += sum(1 for piece in message.tool_calls if piece.id is not None)

    def message(self, text: str) -> dict[str, Any]:
        """The whole choice's ``message`` fields: ``content``, ``tool_calls`` (when any) and
        ``reasoning_content`` (with a reasoning parser)."""
        reasoning: str | None = None
        content: str | None = text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.extract_reasoning(text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.tools is not None:
            extracted = self.tools.extract_tool_calls(content or "")
            self.num_calls = len(extracted.tool_calls)
            if extracted.tools_called:
                message["content"] = extracted.content
                message["tool_calls"] = [call.to_dict() for call in extracted.tool_calls]
        elif content is None:
            message["content"] = "" if reasoning is None else None
        if self.reasoning is not None:
            message["reasoning_content"] = reasoning
        return message

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """``tool_calls`` when ``auto`` or ``required`` made calls and the model stopped; the
        engine's reason otherwise (a named choice answers ``stop``, as OpenAI does)."""
        if engine_reason == "stop" and self.num_calls and self.plan.choice in ("auto", "required"):
            return "tool_calls"
        return engine_reason


__all__ = [
    "AUTO_NEEDS_FLAGS",
    "MAX_TOOLS",
    "ChoiceDelta",
    "ChoiceParser",
    "ToolPlan",
    "ToolServerOptions",
    "plan_tools",
    "resolve_server_options",
]
