"""Llama 3 JSON tool calls: the answer is one or more JSON objects separated by ``;``, optionally
after ``<|python_tag|>``::

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", ...}

An answer that does not start with a call (after whitespace) is content; text after the last
call is content.
"""

from __future__ import annotations

from kiln.entrypoints.openai.tool_parsers.base import (
    CallStreamParser,
    DeltaMessage,
    ToolParserOptions,
)

_WHITESPACE = " \t\n\r"


class JsonCallsParser(CallStreamParser):
    """Calls that may only start the answer: after ``prefix`` (if given) or at an ``opener``
    character, separated by ``separator``; ``closer`` ends them."""

    prefix: str | None = None
    opener = "{"
    separator = ";"
    closer: str | None = None

    def __init__(self, options: ToolParserOptions | None = None) -> None:
        super().__init__(options)
        self.is_at_start = True

    def _scan_content(self, text: str) -> tuple[str, str | None, str]:
        if not self.is_at_start:
            return text, None, ""
        stripped = text.lstrip(_WHITESPACE)
        leading = text[: len(text) - len(stripped)]
        prefix = self.prefix
        if not stripped or (prefix and prefix.startswith(stripped) and stripped != prefix):
            return "", None, text  # not decided yet
        self.is_at_start = False
        if prefix and stripped.startswith(prefix):
            return "", leading + prefix, stripped[len(prefix) :]
        if stripped.startswith(self.opener):
            if self.opener == "{":
                return "", leading, stripped
            return "", leading + self.opener, stripped[len(self.opener) :]
        return text, None, ""

    def _scan_between(self, text: str) -> tuple[str, str]:
        if text.startswith(self.separator):
            return "open", text[len(self.separator) :]
        if self.closer is not None:
            if text.startswith(self.closer):
                return "skip", ""
            self.is_malformed = True
            return "skip", ""
        return "content", text

    def finish(self) -> DeltaMessage:
        if self.state == "content" and self.is_at_start:
            self.is_at_start = False  # undecided whitespace or a partial prefix is content
        return super().finish()


class Llama3JsonToolParser(JsonCallsParser):
    """``--tool-call-parser llama3_json``."""

    prefix = "<|python_tag|>"


class RequiredCallsParser(JsonCallsParser):
    """The answer to ``tool_choice`` ``required``: a JSON array of
    ``{"name": ..., "parameters": {...}}``, as the structured output for it demands."""

    opener = "["
    separator = ","
    closer = "]"


__all__ = ["JsonCallsParser", "Llama3JsonToolParser", "RequiredCallsParser"]
