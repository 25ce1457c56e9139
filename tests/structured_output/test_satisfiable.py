"""The admission check for grammars no finite output satisfies (issue 26 item 6): refused with
the field named, while recursive grammars with a way out are accepted."""

from __future__ import annotations

import pytest

from kiln.sampling_params import StructuredOutputsParams
from kiln.structured_output.backends import choose_backend
from kiln.structured_output.satisfiable import UnsatisfiableGrammarError, ends_rule

SELF = {"$ref": "#"}


@pytest.mark.parametrize(
    "spec",
    [
        {"grammar": "root ::= root"},
        {"grammar": 'root ::= "a" root'},
        {"grammar": 'root ::= x\nx ::= "(" y\ny ::= x ")" | "[" x'},
        {"json": SELF},
        {"json": {"type": "object", "properties": {"a": SELF}, "required": ["a"]}},
        {"json": {"type": "array", "items": SELF, "minItems": 1}},
    ],
)
def test_unsatisfiable_is_refused_by_every_backend_choice(spec: dict) -> None:
    params = StructuredOutputsParams(**spec)
    for backend in ("auto", "xgrammar"):
        with pytest.raises(UnsatisfiableGrammarError, match=f"structured_outputs.{params.kind}"):
            choose_backend(params, backend)


@pytest.mark.parametrize(
    "spec",
    [
        {"grammar": 'root ::= "(" root ")" | "x"'},
        {"grammar": 'root ::= ("a" root)* "b"'},
        {"grammar": 'root ::= "a" | b\nb ::= b "x"'},  # b never ends, root does without it
        {"json": {"type": "object", "properties": {"a": SELF}}},
        {"json": {"type": "array", "items": SELF}},
        {"regex": "a+b"},
        {"choice": ["yes"]},
    ],
)
def test_recursion_with_a_way_out_is_accepted(spec: dict) -> None:
    assert choose_backend(StructuredOutputsParams(**spec), "auto") == "xgrammar"


def test_unreadable_or_huge_forms_are_accepted() -> None:
    assert ends_rule("root ::= TagDispatch(...)") is None
    assert ends_rule("root ::= " + "(" * 5000 + '"x"' + ")" * 5000) is None
    assert ends_rule("root ::= root\n" + "x ::= " + '"a" ' * (1 << 19)) is None
