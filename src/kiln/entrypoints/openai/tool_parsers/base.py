"""What a tool parser is, and the two machines Kiln's parsers are built from.

Contract: a ``ToolParser`` turns the answer text of one choice into content and tool calls. A
parser object serves one choice and keeps state: ``extract_tool_calls_streaming`` is fed the text
deltas in order and returns what to stream now (content, and tool-call pieces the way OpenAI
streams them: first ``id``, ``type`` and ``name``, then fragments of ``arguments``), and
``finish`` returns what it held back. ``extract_tool_calls`` parses a whole text (on a fresh copy,
so it may be called on any parser). Kiln's parsers compute the whole-text result by streaming,
so the streamed pieces reassemble to exactly the non-streamed calls; a whole text whose calls do
not parse is returned as plain content.

Arguments are the JSON text the model wrote for them (so their pieces are exact substrings of
the output); a model that wrote them as a JSON string gets that string, decoded.

Hostile output is bounded: a call longer than ``max_call_chars`` is malformed, and calls past
``max_calls`` are dropped. The parser knows nothing about HTTP or the engine: text in, deltas out.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from kiln.entrypoints.openai.tool_parsers.json_scan import ObjectScanner

DEFAULT_MAX_CALL_CHARS = 2**17
"""The most characters one call's JSON may hold before it counts as malformed."""
DEFAULT_MAX_CALLS = 128
"""The most calls one answer may make (OpenAI's cap on tools per request)."""
ARGUMENT_KEYS = ("arguments", "parameters")
"""Where a call's arguments may be: Hermes-style calls say ``arguments``, Llama 3 ``parameters``."""
_WHITESPACE = " \t\n\r"


def make_tool_call_id() -> str:
    """A tool call id in vLLM's form."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCall:
    """One complete call."""

    name: str
    arguments: str
    """The arguments as JSON text."""
    id: str = field(default_factory=make_tool_call_id)

    def to_dict(self) -> dict[str, Any]:
        """The call as in a message's ``tool_calls``."""
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


@dataclass
class DeltaToolCall:
    """A piece of call ``index``: its first piece has ``id`` and ``name``."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The piece as in a chunk's ``delta.tool_calls``."""
        piece: dict[str, Any] = {"index": self.index}
        function: dict[str, Any] = {}
        if self.id is not None:
            piece["id"] = self.id
            piece["type"] = "function"
        if self.name is not None:
            function["name"] = self.name
        function["arguments"] = self.arguments
        piece["function"] = function
        return piece


@dataclass
class DeltaMessage:
    """What one text delta adds to the answer."""

    content: str = ""
    tool_calls: list[DeltaToolCall] = field(default_factory=list)

    def extend(self, other: DeltaMessage) -> None:
        """Append ``other``, merging pieces of the same call."""
        self.content += other.content
        for piece in other.tool_calls:
            last = self.tool_calls[-1] if self.tool_calls else None
            if last is not None and last.index == piece.index and piece.id is None:
                last.arguments += piece.arguments
            else:
                self.tool_calls.append(DeltaToolCall(**vars(piece)))


@dataclass
class ExtractedToolCalls:
    """The result of a whole text: calls, and the content outside them (None when empty)."""

    tool_calls: list[ToolCall]
    content: str | None

    @property
    def tools_called(self) -> bool:
        return bool(self.tool_calls)


@dataclass(frozen=True)
class ToolParserOptions:
    """What a parser is told about the request it serves."""

    tool_names: tuple[str, ...] = ()
    """The names of the request's tools (a parser may ignore calls to other names)."""
    max_calls: int = DEFAULT_MAX_CALLS
    """Calls past this many are dropped (1 when ``parallel_tool_calls`` is false)."""
    max_call_chars: int = DEFAULT_MAX_CALL_CHARS


class ToolParser:
    """The interface of a tool parser (see the module docstring). Subclass it, implement
    ``extract_tool_calls_streaming`` and ``finish``, and register the class by name in
    ``TOOL_PARSER_REGISTRY``."""

    def __init__(self, options: ToolParserOptions | None = None) -> None:
        self.options = options or ToolParserOptions()
        self.is_malformed = False
        """A call did not parse (the whole-text result is then plain content)."""

    def extract_tool_calls_streaming(self, delta_text: str) -> DeltaMessage:
        """What to stream for ``delta_text``, the next piece of the answer."""
        raise NotImplementedError

    def finish(self) -> DeltaMessage:
        """What was held back, at the end of the answer."""
        raise NotImplementedError

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        """The calls and content of a whole answer (state of this parser untouched)."""
        parser = type(self)(self.options)
        message = DeltaMessage()
        message.extend(parser.extract_tool_calls_streaming(text))
        message.extend(parser.finish())
        calls = [
            ToolCall(piece.name or "", piece.arguments, piece.id or make_tool_call_id())
            for piece in message.tool_calls
        ]
        if parser.is_malformed or not all(_is_json_object(call.arguments) for call in calls):
            return ExtractedToolCalls([], text)
        return ExtractedToolCalls(calls, message.content or None)


def _is_json_object(text: str) -> bool:
    # RecursionError: arguments written as a JSON string are not depth-checked by the scanner.
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):
        return False


class _Call:
    """One call being scanned: emits its first piece once the name is complete, then each new
    part of its arguments."""

    def __init__(self, index: int, max_chars: int) -> None:
        self.index = index
        self.max_chars = max_chars
        self.scanner = ObjectScanner()
        self.name: str | None = None
        self.sent = 0
        """Characters of the raw arguments already streamed."""
        self.is_started = False
        self.is_bad = False

    @property
    def is_done(self) -> bool:
        return self.scanner.end is not None and not self.is_bad

    def feed(self, piece: str) -> tuple[DeltaToolCall | None, str]:
        """Scan ``piece``: the piece of the call to stream (if any) and the text after it."""
        scanner = self.scanner
        rest = scanner.feed(piece)
        if scanner.is_malformed or len(scanner.text) > self.max_chars:
            self.is_bad = True
            return None, rest
        delta = DeltaToolCall(self.index)
        if self.name is None and scanner.is_closed("name"):
            try:
                name = json.loads(scanner.value_text("name") or '""')
            except ValueError:
                name = None
            if not isinstance(name, str) or not name:
                self.is_bad = True
                return None, rest
            self.name = delta.name = name
            delta.id = make_tool_call_id()
            self.is_started = True
        elif self.name is None and scanner.end is not None:
            self.is_bad = True  # an object without a name is not a call
            return None, rest
        if self.name is not None:
            delta.arguments = self._new_arguments()
            if self.is_bad:
                return None, rest
        if delta.name is None and not delta.arguments:
            return None, rest
        return delta, rest

    def _new_arguments(self) -> str:
        scanner = self.scanner
        key = next((k for k in ARGUMENT_KEYS if k in scanner.values), None)
        if key is None:
            return "{}" if scanner.end is not None and not self.sent and self._mark_sent(2) else ""
        raw = scanner.value_text(key) or ""
        if raw.startswith('"'):  # arguments written as a JSON string: sent whole, decoded
            if not scanner.is_closed(key) or self.sent:
                return ""
            try:
                decoded = json.loads(raw)
            except ValueError:  # an escape JSON does not have
                self.is_bad = True
                return ""
            self._mark_sent(len(raw))
            return decoded if isinstance(decoded, str) else ""
        new = raw[self.sent :]
        self.sent = len(raw)
        return new

    def _mark_sent(self, size: int) -> bool:
        self.sent = size
        return True


class CallStreamParser(ToolParser):
    """The machine Kiln's parsers share: content, then calls, each a JSON object with ``name``
    and ``arguments`` (or ``parameters``). Subclasses say where calls start and end by
    overriding ``_scan_content`` and ``_scan_between``.

    States: ``content`` (text for the user), ``open`` (a call's ``{`` is expected), ``call``
    (inside a call's object), ``between`` (after a call), ``skip`` (the rest is dropped).
    """

    def __init__(self, options: ToolParserOptions | None = None) -> None:
        super().__init__(options)
        self.state = "content"
        self.pending = ""
        """Text not decided yet (a tag that may be starting)."""
        self.held_ws = ""
        """Trailing whitespace of the content, sent once more content follows."""
        self.raw = ""
        """Text since the content ended, given back as content if no call starts there."""
        self.calls: list[_Call] = []

    # -- what subclasses decide -----------------------------------------------------------------

    def _scan_content(self, text: str) -> tuple[str, str | None, str]:
        """In ``content``: ``(content, marker, rest)``: the content up to where calls start, the
        text that started them (None while they have not started), and the text after it
        (when they have not started: what to hold back)."""
        raise NotImplementedError

    def _scan_between(self, text: str) -> tuple[str, str]:
        """In ``between``, with leading whitespace stripped: ``(next_state, rest)`` where
        ``next_state`` is ``open`` (another call), ``content``, ``skip``, or ``between`` (wait for
        more text; ``rest`` is then what to hold)."""
        raise NotImplementedError

    # -- the machine ----------------------------------------------------------------------------

    def extract_tool_calls_streaming(self, delta_text: str) -> DeltaMessage:
        message = DeltaMessage()
        text = self.pending + delta_text
        self.pending = ""
        while text:
            text = self._step(text, message)
        return message

    def _step(self, text: str, message: DeltaMessage) -> str:
        """Consume some of ``text`` in the current state; returns the rest."""
        state = self.state
        if state == "content":
            content, marker, rest = self._scan_content(text)
            self._emit_content(content, message)
            if marker is None:
                self.pending = rest
                return ""
            self.held_ws = ""
            self.raw = marker
            self.state = "open"
            return rest
        if state == "open":
            stripped = text.lstrip(_WHITESPACE)
            self.raw += text[: len(text) - len(stripped)]
            if not stripped:
                return ""
            if len(self.calls) >= self.options.max_calls:
                self.state = "skip"  # calls past the cap are dropped, the others stand
                return ""
            if stripped[0] != "{":
                return self._bad_call(stripped, message, started=False)
            self.calls.append(_Call(len(self.calls), self.options.max_call_chars))
            self.state = "call"
            return stripped
        if state == "call":
            call = self.calls[-1]
            before = len(call.scanner.text)
            delta, rest = call.feed(text)
            self.raw += call.scanner.text[before:]
            if call.is_bad:
                self.calls.pop()
                return self._bad_call(rest, message, started=call.is_started)
            if delta is not None:
                message.extend(DeltaMessage(tool_calls=[delta]))
            if call.is_done:
                self.state = "between"
            return rest
        if state == "between":
            stripped = text.lstrip(_WHITESPACE)
            if not stripped:
                return ""
            next_state, rest = self._scan_between(stripped)
            if next_state == "between":
                self.pending = rest
                return ""
            self.state = next_state
            self.raw = ""
            return rest
        return ""  # skip

    def _bad_call(self, rest: str, message: DeltaMessage, *, started: bool) -> str:
        """A call that does not parse. Where it is the first and none of it was streamed, its
        text is content again (scanning goes on after it); otherwise the rest of the answer is
        dropped. Either way the whole text has no calls."""
        self.is_malformed = True
        if started or self.calls:
            self.state = "skip"
            return ""
        self.state = "content"
        self._emit_content(self.raw, message)
        self.raw = ""
        return rest

    def _emit_content(self, text: str, message: DeltaMessage, final: bool = False) -> None:
        """Content, with trailing whitespace held until more content follows (whitespace next to
        a call is not content)."""
        text = self.held_ws + text
        kept = text if final else text.rstrip(_WHITESPACE)
        self.held_ws = text[len(kept) :]
        message.content += kept

    def finish(self) -> DeltaMessage:
        message = DeltaMessage()
        if self.state == "content":
            self._emit_content(self.pending, message, final=not self.calls)
        elif self.state in ("open", "call"):
            call = self.calls[-1] if self.state == "call" else None
            if call is not None and not call.is_started:
                self.calls.pop()
            if self.calls or (call is not None and call.is_started):
                self.is_malformed = True  # cut off inside a call
            else:
                self._bad_call("", message, started=False)
                self._emit_content("", message, final=True)
        self.pending = ""
        return message


__all__ = [
    "ARGUMENT_KEYS",
    "CallStreamParser",
    "DeltaMessage",
    "DeltaToolCall",
    "ExtractedToolCalls",
    "ToolCall",
    "ToolParser",
    "ToolParserOptions",
    "make_tool_call_id",
]
