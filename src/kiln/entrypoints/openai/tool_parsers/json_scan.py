"""An incremental scanner of one JSON object, for tool-call text that arrives in pieces.

Contract: ``ObjectScanner`` is fed the text of a JSON object from its ``{`` on, in any number of
pieces, and records, for each top-level key, the span of its value in the text fed so far (the
end is None while the value is still open). It reads each character once, so the cost of a call
is linear in its length however it is split. It does not build values: callers cut the spans
they need (a tool's name, its arguments as the model wrote them) and ``json.loads`` them.

It checks the structure (brackets, strings, ``key: value`` pairs), not the grammar of numbers
and literals: ``json.loads`` of a span does that. Values nested deeper than ``max_depth``
containers make the object malformed, so ``json.loads`` of a span never recurses past it (deep
enough text makes it raise ``RecursionError``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

_WHITESPACE = " \t\n\r"
DEFAULT_MAX_DEPTH = 128
"""The most containers a top-level value may nest (``{"a": {"b": 1}}``: 2 for ``a``'s value)."""


@dataclass
class ValueSpan:
    """Where a top-level value lies in the scanned text: ``text[start:end]``."""

    start: int
    end: int | None = None
    """None while the value is open."""


@dataclass
class ObjectScanner:
    """Scans one JSON object fed in pieces (see the module docstring)."""

    text: str = ""
    """Everything fed so far."""
    values: dict[str, ValueSpan] = field(default_factory=dict)
    """Top-level key -> the span of its value."""
    end: int | None = None
    """The index just past the closing ``}``, once it came."""
    is_malformed: bool = False
    """The text cannot be a JSON object, or nests too deep (scanning stopped)."""
    max_depth: int = DEFAULT_MAX_DEPTH
    _state: str = "open"
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False
    _key_start: int = 0
    _key: str = ""

    @property
    def is_done(self) -> bool:
        return self.end is not None or self.is_malformed

    def feed(self, piece: str) -> str:
        """Scan ``piece``; returns the part of it after the object's end (empty while open)."""
        base = len(self.text)
        self.text += piece
        for offset, char in enumerate(piece):
            if self.is_done:
                self.text = self.text[: base + offset]
                return piece[offset:]
            self._step(char, base + offset)
        return ""

    def _fail(self) -> None:
        self.is_malformed = True

    def _step(self, char: str, i: int) -> None:
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._in_string = False
                self._close_string(i)
            return
        state = self._state
        if state == "value" and self._depth > 0:  # inside a container value
            if char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
                if self._depth > self.max_depth:
                    self._fail()
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._close_value(i + 1)
            return
        if state == "primitive":
            if char in _WHITESPACE or char in ",}":
                self._close_value(i)
                self._state = "after_value"
                self._step(char, i)
            return
        if char in _WHITESPACE:
            return
        if state == "open":
            self._state = "key_or_end" if char == "{" else "bad"
            if char != "{":
                self._fail()
        elif state in ("key_or_end", "key"):
            if char == '"':
                self._in_string = True
                self._key_start = i
                self._state = "in_key"
            elif char == "}" and state == "key_or_end":
                self.end = i + 1
            else:
                self._fail()
        elif state == "colon":
            if char == ":":
                self._state = "value_start"
            else:
                self._fail()
        elif state == "value_start":
            self.values[self._key] = ValueSpan(i)
            if char == '"':
                self._in_string = True
                self._state = "string_value"
            elif char in "{[":
                self._depth = 1
                self._state = "value"
            elif char in ",:}]":
                self._fail()
            else:
                self._state = "primitive"
        elif state == "after_value":
            if char == ",":
                self._state = "key"
            elif char == "}":
                self.end = i + 1
            else:
                self._fail()

    def _close_string(self, i: int) -> None:
        if self._state == "in_key":
            try:
                self._key = json.loads(self.text[self._key_start : i + 1])
            except ValueError:
                self._fail()
                return
            self._state = "colon"
        elif self._state == "string_value":
            self._close_value(i + 1)
        # a string inside a container value needs nothing

    def _close_value(self, end: int) -> None:
        self.values[self._key].end = end
        self._state = "after_value"

    def value_text(self, key: str) -> str | None:
        """The raw text of ``key``'s value so far (all of it once closed); None before it."""
        span = self.values.get(key)
        if span is None:
            return None
        return self.text[span.start : span.end if span.end is not None else len(self.text)]

    def is_closed(self, key: str) -> bool:
        span = self.values.get(key)
        return span is not None and span.end is not None


__all__ = ["DEFAULT_MAX_DEPTH", "ObjectScanner", "ValueSpan"]
