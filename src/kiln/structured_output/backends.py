"""Grammar engines behind one small interface: xgrammar and llguidance ("guidance", as vLLM).

Contract: a backend turns a ``StructuredOutputsParams`` into a compiled ``Grammar`` (``compile``,
slow: seconds for a big schema, so the manager runs it in a thread) or checks it without a
tokenizer (``validate``, fast: the admission check). A grammar makes one ``Matcher`` per request;
a matcher fills one row of a token bitmask (int32 ``[rows, ceil(V / 32)]``, bit ``t % 32`` of
word ``t // 32`` set when token ``t`` is allowed: both engines use this layout), advances by
the tokens the request accepted, and rolls back the last tokens it accepted (speculative
decoding: drafts are accepted to check them and to fill their rows, then taken back). EOS (the
tokenizer's stop ids) is allowed only where the grammar is complete.

Backend errors become ``ValueError`` s that name the request field, so the API server answers
them with a 400.

What it must not know: requests, scheduling, tensors beyond the bitmask rows it fills.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

import torch

from kiln.sampling_params import StructuredOutputsParams
from kiln.structured_output.satisfiable import UnsatisfiableGrammarError, ends_rule

BACKENDS = ("xgrammar", "guidance")


class Matcher(Protocol):
    def accept_token(self, token_id: int) -> bool:
        """Advance by ``token_id``; False (state unchanged) when the grammar forbids it or has
        terminated."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (at most ``MAX_NUM_SPECULATIVE_TOKENS``,
        and no more than were accepted): the state is as it was before them."""
        ...

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]``; not called once terminated."""
        ...

    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted."""
        ...


class Grammar(Protocol):
    def make_matcher(self) -> Matcher: ...


def _field(params: StructuredOutputsParams) -> str:
    return f"structured_outputs.{params.kind}"


def _schema(params: StructuredOutputsParams) -> dict[str, Any]:
    if params.kind == "json_object":
        return {"type": "object"}
    schema = params.json
    schema = json.loads(schema) if isinstance(schema, str) else schema
    if params.disable_additional_properties:
        schema = _no_additional_properties(schema)
    assert isinstance(schema, dict)
    return schema


def _no_additional_properties(schema: Any) -> Any:
    """``schema`` with ``"additionalProperties": false`` on every object that does not say."""
    if isinstance(schema, list):
        return [_no_additional_properties(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _no_additional_properties(v) for k, v in schema.items()}
    if out.get("type") == "object" or "properties" in out:
        out.setdefault("additionalProperties", False)
    return out


def _choice_literals(choices: list[str]) -> str:
    # JSON string escapes are what both grammar languages read inside "...".
    return " | ".join(json.dumps(c) for c in choices)


# -- xgrammar ----------------------------------------------------------------------------------


class _XGrammarMatcher:
    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(token_id))

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())


class _XGrammar:
    def __init__(self, compiled: Any) -> None:
        self._compiled = compiled

    def make_matcher(self) -> Matcher:
        import xgrammar

        # NOTE: no max_rollback_tokens: xgrammar 0.2.9 deprecates it, rollback is unlimited.
        return _XGrammarMatcher(xgrammar.GrammarMatcher(self._compiled))


class XGrammarBackend:
    """xgrammar: compiles token masks ahead, so the per-token mask is cheap (the default)."""

    name = "xgrammar"

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar

        info = xgrammar.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
        )
        # One thread per compile: the manager's pool runs several compiles at once.
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, params: StructuredOutputsParams) -> Grammar:
        import xgrammar

        compiler = self._compiler
        kind = params.kind
        try:
            if kind in ("json", "json_object"):
                grammar = xgrammar.Grammar.from_json_schema(
                    json.dumps(_schema(params)), any_whitespace=not params.disable_any_whitespace
                )
                compiled = compiler.compile_grammar(_without_raw_control_characters(grammar))
            elif kind == "regex":
                assert params.regex is not None
                compiled = compiler.compile_regex(params.regex)
            elif kind == "choice":
                assert params.choice is not None
                compiled = compiler.compile_grammar("root ::= " + _choice_literals(params.choice))
            else:
                assert params.grammar is not None
                compiled = compiler.compile_grammar(params.grammar)
        except RuntimeError as exc:
            raise ValueError(f"{_field(params)} is invalid: {_xgrammar_message(exc)}") from None
        return _XGrammar(compiled)

    @staticmethod
    def validate(params: StructuredOutputsParams) -> None:
        """Parse ``params`` without a tokenizer.

        Raises:
            ValueError: xgrammar cannot read it (names the field and the problem).
        """
        import xgrammar

        kind = params.kind
        try:
            if kind in ("json", "json_object"):
                grammar = xgrammar.Grammar.from_json_schema(json.dumps(_schema(params)))
            elif kind == "regex":
                assert params.regex is not None
                grammar = xgrammar.Grammar.from_regex(params.regex)
            elif kind == "grammar":
                assert params.grammar is not None
                grammar = xgrammar.Grammar.from_ebnf(params.grammar)
            else:
                return  # choices: literals, always complete
        except RuntimeError as exc:
            message = _xgrammar_message(exc)
            if "Circular $ref" in message:  # no base case: no backend can complete it
                raise UnsatisfiableGrammarError(f"{_field(params)} is invalid: {message}") from None
            raise ValueError(f"{_field(params)} is invalid: {message}") from None
        rule = ends_rule(str(grammar))
        if rule is not None:
            raise UnsatisfiableGrammarError(
                f"{_field(params)} is invalid: no finite output satisfies it (every alternative "
                f"of rule {rule!r} needs a rule that never ends, such as itself)"
            )


# xgrammar 0.2.9 writes a string with minLength / maxLength as characters of this class, which
# lets raw control characters (U+0000-U+001F) through: JSON forbids them, so the output would not
# parse (the property test found "\x08"). Its unbounded strings exclude them; so does this fix.
_BOUNDED_STRING_CHARACTER = r"[^\"\\\r\n]"
_JSON_STRING_CHARACTER = r"[^\0-\x1f\"\\\r\n]"


def _without_raw_control_characters(grammar: Any) -> Any:
    """``grammar`` (an ``xgrammar.Grammar`` of a JSON schema) with bounded strings that hold only
    characters JSON allows unescaped."""
    import xgrammar

    text = str(grammar)
    if _BOUNDED_STRING_CHARACTER not in text:
        return grammar
    return xgrammar.Grammar.from_ebnf(
        text.replace(_BOUNDED_STRING_CHARACTER, _JSON_STRING_CHARACTER)
    )


def _xgrammar_message(exc: Exception) -> str:
    # "[19:37:00] /project/cpp/regex_converter.cc:94: Regex parsing error ..." -> the message.
    text = str(exc).strip()
    head, sep, tail = text.partition(".cc:")
    if sep and head.startswith("["):
        text = tail.partition(": ")[2] or text
    return text


# -- llguidance --------------------------------------------------------------------------------


class _GuidanceMatcher:
    def __init__(self, matcher: Any, eos_token_id: int) -> None:
        self._matcher = matcher
        self._eos_token_id = eos_token_id
        self._is_stop_accepted = False
        """The stop token was accepted. It is kept here, not fed to llguidance: its rollback does
        not count the stop token as one of the tokens it takes back, and nothing follows it."""

    def accept_token(self, token_id: int) -> bool:
        if self._is_stop_accepted:
            return False
        if token_id == self._eos_token_id:
            self._is_stop_accepted = bool(self._matcher.is_accepting())
            return self._is_stop_accepted
        # A token the grammar forbids would put the matcher in its error state for good: check
        # first, so that a rejected draft leaves it as it was.
        if self._matcher.validate_tokens([token_id]) != 1:
            return False
        return bool(self._matcher.consume_token(token_id))

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and self._is_stop_accepted:
            self._is_stop_accepted = False
            num_tokens -= 1
        if num_tokens:
            is_rolled_back = self._matcher.rollback(num_tokens)
            assert is_rolled_back, self._matcher.get_error()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask(self._matcher, bitmask, row)

    def is_terminated(self) -> bool:
        # NOTE: llguidance's is_stopped() is already True where only the stop token may follow.
        return self._is_stop_accepted


class _GuidanceGrammar:
    def __init__(self, tokenizer: Any, grammar: str) -> None:
        self._tokenizer = tokenizer
        self._grammar = grammar

    def make_matcher(self) -> Matcher:
        import llguidance

        matcher = llguidance.LLMatcher(self._tokenizer, self._grammar)
        return _GuidanceMatcher(matcher, self._tokenizer.eos_token)


class GuidanceBackend:
    """llguidance: compiles almost nothing ahead (fast compile), computes masks per token."""

    name = "guidance"

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        import llguidance.hf

        del stop_token_ids  # llguidance takes the tokenizer's EOS
        self._tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)

    def compile(self, params: StructuredOutputsParams) -> Grammar:
        grammar = self.grammar_text(params)
        self._check(params, grammar, self._tokenizer)
        return _GuidanceGrammar(self._tokenizer, grammar)

    @staticmethod
    def grammar_text(params: StructuredOutputsParams) -> str:
        import llguidance

        kind = params.kind
        if kind in ("json", "json_object"):
            return llguidance.LLMatcher.grammar_from_json_schema(
                _schema(params),
                defaults={"whitespace_flexible": not params.disable_any_whitespace},
            )
        if kind == "regex":
            assert params.regex is not None
            return llguidance.LLMatcher.grammar_from_regex(params.regex)
        if kind == "choice":
            assert params.choice is not None
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + _choice_literals(params.choice)
            )
        assert params.grammar is not None
        return llguidance.LLMatcher.grammar_from_lark(params.grammar)

    @staticmethod
    def _check(params: StructuredOutputsParams, grammar: str, tokenizer: Any) -> None:
        import llguidance

        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise ValueError(f"{_field(params)} is invalid: {error.strip()}")

    @classmethod
    def validate(cls, params: StructuredOutputsParams) -> None:
        """Check ``params`` without a tokenizer.

        Raises:
            ValueError: llguidance cannot read it (names the field and the problem).
        """
        cls._check(params, cls.grammar_text(params), None)


BACKEND_CLASSES: dict[str, type[XGrammarBackend] | type[GuidanceBackend]] = {
    "xgrammar": XGrammarBackend,
    "guidance": GuidanceBackend,
}


def choose_backend(params: StructuredOutputsParams, configured: str) -> str:
    """The backend that runs ``params``: the configured one, or for ``"auto"`` xgrammar unless it
    refuses the spec and llguidance takes it.

    Raises:
        ValueError: the chosen backend (for ``"auto"``: both) cannot read the spec; the message is
            xgrammar's for ``"auto"``.
    """
    if configured != "auto":
        BACKEND_CLASSES[configured].validate(params)
        return configured
    try:
        XGrammarBackend.validate(params)
        return "xgrammar"
    except UnsatisfiableGrammarError:
        raise
    except ValueError as xgrammar_error:
        try:
            GuidanceBackend.validate(params)
        except ValueError:
            raise xgrammar_error from None
        return "guidance"
