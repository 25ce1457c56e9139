"""Hermes-style tool calls, as the Qwen2.5 and Qwen3 chat templates ask for them::

    Some text.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Text outside the tags is content; each tagged JSON object is one call.
"""

from __future__ import annotations

from kiln.entrypoints.openai.tool_parsers.base import CallStreamParser
from kiln.utils import split_partial_tag


class HermesToolParser(CallStreamParser):
    """``--tool-call-parser hermes``."""

    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def _scan_content(self, text: str) -> tuple[str, str | None, str]:
        index = text.find(self.start_tag)
        if index >= 0:
            return text[:index], self.start_tag, text[index + len(self.start_tag) :]
        safe, held = split_partial_tag(text, self.start_tag)
        return safe, None, held

    def _scan_between(self, text: str) -> tuple[str, str]:
        if text.startswith(self.end_tag):
            return "content", text[len(self.end_tag) :]
        if self.end_tag.startswith(text):
            return "between", text
        return "content", text  # no end tag: what follows is content


__all__ = ["HermesToolParser"]
