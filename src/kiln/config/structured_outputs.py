"""``StructuredOutputsConfig``: the grammar engine of structured outputs and its bounds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kiln.config.checks import check, parse_json_fields

STRUCTURED_OUTPUT_BACKENDS = ("auto", "xgrammar", "guidance")
"""Values of ``structured_outputs.backend`` (``"guidance"`` is llguidance, as in vLLM)."""


def parse_structured_outputs_config(value: str | dict[str, Any] | None) -> dict[str, Any]:
    """``--structured-outputs-config``: JSON (or, from Python, a dict) of
    ``StructuredOutputsConfig`` fields, ``'{"backend": "xgrammar"}'``.

    Raises:
        ValueError: not JSON, not an object, or a key that is no field (names the allowed ones).
    """
    if not value:
        return {}
    return parse_json_fields(
        value,
        "structured_outputs_config",
        StructuredOutputsConfig,
        '\'{"backend": "xgrammar"}\'',
        exclude=("reasoning_parser",),
    )


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """Structured outputs (JSON schema, regex, choice, grammar): the grammar engine and its bounds.

    The grammar fields are set by one flag, ``--structured-outputs-config '{"backend":
    "guidance"}'``; ``reasoning_parser`` by its own, ``--reasoning-parser`` (vLLM's flags)."""

    backend: str = field(
        default="auto",
        metadata={
            "flag": "structured_outputs_config",
            "metavar": "JSON",
            "parse": parse_structured_outputs_config,
        },
    )
    """Grammar engine: "xgrammar", "guidance" (llguidance), or "auto": xgrammar, and llguidance for
    a spec xgrammar does not support."""
    max_compile_seconds: float = field(
        default=30.0, metadata={"set_by": "structured_outputs_config"}
    )
    """A request whose grammar has not compiled after this long finishes with finish reason
    "error" (compiles run in a thread pool, never on the engine loop)."""
    enable_in_reasoning: bool = field(
        default=False, metadata={"set_by": "structured_outputs_config"}
    )
    """With a reasoning parser, constrain the thinking too: the grammar applies from the first
    token instead of after the thinking (vLLM's option of that name)."""
    disable_any_whitespace: bool = field(
        default=False, metadata={"set_by": "structured_outputs_config"}
    )
    """Every JSON grammar of this server without whitespace between tokens (no newlines or
    indentation), as if each request set it: a small model then cannot run on in whitespace."""
    disable_additional_properties: bool = field(
        default=False, metadata={"set_by": "structured_outputs_config"}
    )
    """Every JSON schema of this server read as ``"additionalProperties": false`` where it does
    not say, as if each request set it."""
    reasoning_parser: str | None = field(default=None, metadata={"metavar": "NAME"})
    """The model thinks before it answers, in this parser's format: qwen3 (<think>...</think>) or
    a name a plugin registered. The chat route splits the thinking into reasoning_content, and a
    structured output constrains only the answer after it, as in vLLM."""

    def __post_init__(self) -> None:
        check(
            self.backend in STRUCTURED_OUTPUT_BACKENDS,
            "structured_outputs.backend",
            self.backend,
            str(STRUCTURED_OUTPUT_BACKENDS),
        )
        for name in (
            "enable_in_reasoning",
            "disable_any_whitespace",
            "disable_additional_properties",
        ):
            value = getattr(self, name)
            check(isinstance(value, bool), f"structured_outputs.{name}", value, "true or false")
        check(
            isinstance(self.max_compile_seconds, (int, float)) and self.max_compile_seconds > 0,
            "structured_outputs.max_compile_seconds",
            self.max_compile_seconds,
            "a number of seconds > 0",
        )
