"""Tool parsers: the model's answer text -> content and OpenAI ``tool_calls``.

``TOOL_PARSER_REGISTRY`` maps a ``--tool-call-parser`` name to the dotted path of a
``ToolParser`` subclass, imported when a server starts with that name. Kiln registers ``hermes``
(``<tool_call>`` JSON, the Qwen2.5/Qwen3 templates) and ``llama3_json``; a general plugin adds
its own with ``TOOL_PARSER_REGISTRY.register("name", "pkg.mod.MyParser")`` (``override=True`` to
replace one of Kiln's). See ``base`` for the interface.
"""

from __future__ import annotations

from kiln.entrypoints.openai.tool_parsers.base import (
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCalls,
    ToolCall,
    ToolParser,
    ToolParserOptions,
)
from kiln.plugins.registry import Registry
from kiln.utils import resolve_registered_class

_BUILTIN_TOOL_PARSERS = {
    "hermes": "kiln.entrypoints.openai.tool_parsers.hermes.HermesToolParser",
    "llama3_json": "kiln.entrypoints.openai.tool_parsers.llama3_json.Llama3JsonToolParser",
}
TOOL_PARSER_REGISTRY: Registry[str] = Registry("tool parser", builtins=_BUILTIN_TOOL_PARSERS)


def resolve_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered as ``name`` (``ValueError``: unknown, or not a
    ``ToolParser``)."""
    return resolve_registered_class(TOOL_PARSER_REGISTRY, name, ToolParser, "--tool-call-parser")


__all__ = [
    "TOOL_PARSER_REGISTRY",
    "DeltaMessage",
    "DeltaToolCall",
    "ExtractedToolCalls",
    "ToolCall",
    "ToolParser",
    "ToolParserOptions",
    "resolve_tool_parser",
]
