"""Whether a grammar can ever be complete: the admission check that refuses ``root ::= root``.

Contract: ``ends_rule(ebnf)`` reads a grammar in the normal form xgrammar prints
(``str(xgrammar.Grammar)``: one ``name ::= body`` a line, a body of string literals, character
classes, rule names, ``( )``, ``|``, ``*``, ``+``, ``?``, ``{m, n}`` and lookaheads ``(= ...)``)
and returns the name of the root rule when no finite text matches it (every way through it
needs itself again, like ``root ::= root`` or a JSON schema whose ``$ref`` has no base case), or
None. A rule can end when one alternative needs only rules that can end (repetitions that allow
zero copies need nothing); the check iterates that to a fixed point, a pass per rule at most.

It errs towards accepting: a form it does not read, a grammar larger than ``MAX_GRAMMAR_CHARS``
or a fixed point past ``MAX_STEPS`` node visits is accepted (the engine then bounds the request
by ``max_tokens``). Lookaheads and character classes count as satisfiable. It knows nothing about
tokenizers or requests.
"""

from __future__ import annotations

import re

MAX_GRAMMAR_CHARS = 1 << 20
"""Grammars longer than this (as printed) are not checked."""
MAX_STEPS = 2_000_000
"""Node visits the fixed point may take before the check gives up (and accepts)."""

_TOKEN = re.compile(
    r'\s*(?:(?P<string>"(?:[^"\\]|\\.)*")|(?P<cls>\[(?:[^\]\\]|\\.)*\])|(?P<name>[A-Za-z_][\w.]*)'
    r"|(?P<repeat>\{\s*\d+\s*,\s*-?\d+\s*\})|(?P<look>\(=)|(?P<op>[()|*+?]))",
    re.DOTALL,
)

# Nodes: True (a terminal), a rule name (str), ("seq", [nodes]), ("alt", [nodes]), ("opt", node)
# (may be left out: ``*``, ``?``, ``{0, n}``).
_Node = object


class UnsatisfiableGrammarError(ValueError):
    """No finite text completes the grammar (a 400: no other backend should be tried)."""


class _Unreadable(Exception):
    """A form the check does not read (it then accepts the grammar)."""


class _Parser:
    def __init__(self, text: str) -> None:
        self.tokens: list[tuple[str, str]] = []
        pos = 0
        text = text.rstrip()
        while pos < len(text):
            match = _TOKEN.match(text, pos)
            if match is None or match.end() == pos:
                raise _Unreadable(text[pos : pos + 20])
            kind = match.lastgroup
            assert kind is not None
            self.tokens.append((kind, match.group(kind)))
            pos = match.end()
        self.i = 0

    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def alternatives(self) -> _Node:
        options = [self.sequence()]
        while self.peek() == ("op", "|"):
            self.i += 1
            options.append(self.sequence())
        return options[0] if len(options) == 1 else ("alt", options)

    def sequence(self) -> _Node:
        items: list[_Node] = []
        while (token := self.peek()) is not None and token not in (("op", "|"), ("op", ")")):
            items.append(self.postfix())
        return ("seq", items)

    def postfix(self) -> _Node:
        node = self.atom()
        while (token := self.peek()) is not None:
            kind, text = token
            if (kind, text) in (("op", "*"), ("op", "?")) or (
                kind == "repeat" and int(text[1:].split(",")[0]) == 0
            ):
                node = ("opt", node)
            elif (kind, text) != ("op", "+") and kind != "repeat":
                break
            self.i += 1
        return node

    def atom(self) -> _Node:
        token = self.peek()
        if token is None:
            raise _Unreadable("end of rule")
        kind, text = token
        self.i += 1
        if kind in ("string", "cls"):
            return True
        if kind == "name":
            return text
        if kind == "look" or token == ("op", "("):
            node = self.alternatives()
            if self.peek() != ("op", ")"):
                raise _Unreadable("unclosed group")
            self.i += 1
            return True if kind == "look" else node
        raise _Unreadable(text)


def _parse(ebnf: str) -> tuple[dict[str, _Node], str]:
    rules: dict[str, _Node] = {}
    root = None
    for line in ebnf.splitlines():
        if not line.strip():
            continue
        name, sep, body = line.partition(" ::= ")
        if not sep:
            raise _Unreadable(line[:40])
        rules[name.strip()] = _Parser(body).alternatives()
        root = root or name.strip()
    if root is None:
        raise _Unreadable("no rule")
    return rules, "root" if "root" in rules else root


def ends_rule(ebnf: str) -> str | None:
    """The root rule's name when no finite text completes the grammar ``ebnf``; else None."""
    if len(ebnf) > MAX_GRAMMAR_CHARS:
        return None
    try:
        rules, root = _parse(ebnf)
    except (_Unreadable, RecursionError):  # RecursionError: groups nested past the stack
        return None
    can_end: set[str] = set()
    steps = 0

    def ends(node: _Node) -> bool:
        nonlocal steps
        steps += 1
        if node is True:
            return True
        if isinstance(node, str):
            return node in can_end if node in rules else True  # an unknown name: accept
        assert isinstance(node, tuple)
        kind, body = node[0], node[1]
        if kind == "opt":
            return True
        if kind == "seq":
            return all(ends(item) for item in body)
        return any(ends(item) for item in body)

    changed = True
    while changed and root not in can_end:
        changed = False
        for name, node in rules.items():
            try:
                if name not in can_end and ends(node):
                    can_end.add(name)
                    changed = True
            except RecursionError:
                return None
            if steps > MAX_STEPS:
                return None
    return None if root in can_end else root


__all__ = ["MAX_GRAMMAR_CHARS", "MAX_STEPS", "UnsatisfiableGrammarError", "ends_rule"]
