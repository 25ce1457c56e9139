"""Reasoning parsers: the model's text -> ``reasoning_content`` (its thinking) and ``content``.

``REASONING_PARSER_REGISTRY`` maps a ``--reasoning-parser`` name to the dotted path of a
``ReasoningParser`` subclass. Kiln registers ``qwen3`` (``<think>...</think>``); a general plugin
adds its own with ``REASONING_PARSER_REGISTRY.register("name", "pkg.mod.MyParser")``.

Two users, as in vLLM (``vllm.reasoning``):

- the chat route splits each choice: a parser object serves one choice and keeps state.
  ``extract_reasoning_streaming`` is fed the text deltas in order and returns
  ``(reasoning, content)`` to stream now (a tag that may be arriving is held back); ``finish``
  returns what was held. ``extract_reasoning`` splits a whole text (on a fresh copy) and is
  computed by streaming, so both forms agree; an empty part is None.
- the engine core starts a request's structured-output grammar only once
  ``is_reasoning_end(text)`` says the thinking is over (``kiln.structured_output``).

It knows nothing about HTTP, tools, tokens or the engine.
"""

from __future__ import annotations

from kiln.plugins.registry import Registry
from kiln.utils import resolve_registered_class, split_partial_tag

REASONING_PARSER_REGISTRY: Registry[str] = Registry("reasoning parser")

_WHITESPACE = " \t\n\r"


class ReasoningParser:
    """The interface (see the module docstring)."""

    def extract_reasoning_streaming(self, delta_text: str) -> tuple[str, str]:
        """``(reasoning, content)`` to stream for ``delta_text``."""
        raise NotImplementedError

    def finish(self) -> tuple[str, str]:
        """``(reasoning, content)`` held back, at the end of the text."""
        raise NotImplementedError

    def is_reasoning_end(self, text: str) -> bool:
        """Whether the thinking is over at the end of ``text`` (a prompt and the output so far):
        from then on the answer follows, and a structured output constrains it."""
        raise NotImplementedError

    def extract_reasoning(self, text: str) -> tuple[str | None, str | None]:
        """``(reasoning, content)`` of a whole text; None for an empty part."""
        parser = type(self)()
        reasoning, content = parser.extract_reasoning_streaming(text)
        more_reasoning, more_content = parser.finish()
        return (reasoning + more_reasoning) or None, (content + more_content) or None


class ThinkTagReasoningParser(ReasoningParser):
    """Thinking between ``start_tag`` and ``end_tag`` at the start of the answer (after
    whitespace); the rest is content. An answer that does not open with ``start_tag`` is all
    content; one cut off before ``end_tag`` is all reasoning."""

    start_tag = "<think>"
    end_tag = "</think>"

    def __init__(self) -> None:
        self.state = "start"
        self.pending = ""

    def extract_reasoning_streaming(self, delta_text: str) -> tuple[str, str]:
        text = self.pending + delta_text
        self.pending = ""
        if self.state == "start":
            stripped = text.lstrip(_WHITESPACE)
            if not stripped or (self.start_tag.startswith(stripped) and stripped != self.start_tag):
                self.pending = text
                return "", ""
            if not stripped.startswith(self.start_tag):
                self.state = "content"
                return "", text
            self.state = "thinking"
            text = stripped[len(self.start_tag) :]
        if self.state == "thinking":
            index = text.find(self.end_tag)
            if index < 0:
                reasoning, self.pending = split_partial_tag(text, self.end_tag)
                return reasoning, ""
            self.state = "content"
            return text[:index], text[index + len(self.end_tag) :]
        return "", text

    def finish(self) -> tuple[str, str]:
        held, self.pending = self.pending, ""
        return (held, "") if self.state == "thinking" else ("", held)

    def is_reasoning_end(self, text: str) -> bool:
        # The last tag decides (vLLM's rule): "...</think>" ended, "<think>..." is still open,
        # and a text with neither has not started its answer.
        return text.rfind(self.end_tag) > text.rfind(self.start_tag)


class Qwen3ReasoningParser(ThinkTagReasoningParser):
    """``--reasoning-parser qwen3``: ``<think>...</think>``."""


REASONING_PARSER_REGISTRY.register_builtins({"qwen3": "kiln.reasoning.Qwen3ReasoningParser"})


def resolve_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class registered as ``name`` (``ValueError``: unknown, or not a
    ``ReasoningParser``)."""
    return resolve_registered_class(
        REASONING_PARSER_REGISTRY, name, ReasoningParser, "--reasoning-parser"
    )


__all__ = [
    "REASONING_PARSER_REGISTRY",
    "Qwen3ReasoningParser",
    "ReasoningParser",
    "ThinkTagReasoningParser",
    "resolve_reasoning_parser",
]
