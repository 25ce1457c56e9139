"""``SpeculativeConfig``: speculative decoding, a proposer and how many tokens it drafts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kiln.config.checks import check, is_int, parse_json_fields
from kiln.config.model import QUANTIZATION_METHODS

SPECULATIVE_METHODS = ("ngram", "draft_model")
"""Values of ``speculative.method`` (None: no speculation)."""

MAX_NUM_SPECULATIVE_TOKENS = 32
"""Most drafts per request per step: each is a verified position (and, with a draft model, one
more sequential draft forward), and runs that long are essentially never all accepted."""

_SPECULATIVE_EXAMPLE = '\'{"method": "ngram", "num_speculative_tokens": 4}\''


def parse_speculative_config(value: str | dict[str, Any] | None) -> dict[str, Any]:
    """``--speculative-config``: JSON (or, from Python, a dict) of ``SpeculativeConfig`` fields.

    As vLLM: with ``ngram``, a missing ``prompt_lookup_min`` / ``prompt_lookup_max`` takes the
    other's value, and both missing are 5; a ``model`` without a ``method`` is ``draft_model``.

    Raises:
        ValueError: not JSON, not an object, or a key that is no field (names the allowed ones).
    """
    if not value:
        return {}
    data = parse_json_fields(value, "speculative_config", SpeculativeConfig, _SPECULATIVE_EXAMPLE)
    if data.get("model") is not None and data.get("method") is None:
        data["method"] = "draft_model"
    if data.get("method") == "ngram":
        lookup_min, lookup_max = data.get("prompt_lookup_min"), data.get("prompt_lookup_max")
        if lookup_min is None and lookup_max is None:
            lookup_min = lookup_max = 5
        data["prompt_lookup_min"] = lookup_max if lookup_min is None else lookup_min
        data["prompt_lookup_max"] = lookup_min if lookup_max is None else lookup_max
    return data


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a cheap proposer drafts tokens that the model verifies in one forward,
    keeping exactly the model's output distribution (greedy output token for token).

    All fields are set by one flag, ``--speculative-config`` (``LLM(speculative_config={...})``),
    as vLLM: ``'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'`` or
    ``'{"method": "draft_model", "model": "small.gguf", "num_speculative_tokens": 3}'``."""

    method: str | None = field(
        default=None,
        metadata={
            "flag": "speculative_config",
            "metavar": "JSON",
            "parse": parse_speculative_config,
        },
    )
    """None: no speculation; "ngram": prompt lookup (drafts are the tokens that followed the
    latest earlier occurrence of the request's last n tokens, prompt and output); "draft_model":
    a smaller model with the same vocabulary (``model``) drafts, with its own KV cache."""
    num_speculative_tokens: int = field(default=0, metadata={"set_by": "speculative_config"})
    """Most draft tokens a request verifies per step (1 to ``MAX_NUM_SPECULATIVE_TOKENS`` when
    ``method`` is set)."""
    prompt_lookup_min: int = field(default=5, metadata={"set_by": "speculative_config"})
    """ngram: the shortest suffix n-gram looked up."""
    prompt_lookup_max: int = field(default=5, metadata={"set_by": "speculative_config"})
    """ngram: the longest suffix n-gram looked up (the longest that matches wins)."""
    model: str | None = field(default=None, metadata={"set_by": "speculative_config"})
    """draft_model: the draft (a GGUF file or a Hugging Face folder, as ``model.model``), loaded
    with the target's dtype; its vocabulary must be the target's."""
    quantization: str | None = field(default=None, metadata={"set_by": "speculative_config"})
    """draft_model: the draft's ``model.quantization`` (None: "auto", as for the target)."""

    def __post_init__(self) -> None:
        check(
            self.method is None or self.method in SPECULATIVE_METHODS,
            "speculative.method",
            self.method,
            f"None or one of {list(SPECULATIVE_METHODS)}",
        )
        if self.method is None:
            check(
                self.num_speculative_tokens == 0,
                "speculative.num_speculative_tokens",
                self.num_speculative_tokens,
                "0 without a method (set speculative.method)",
            )
            return
        check(
            is_int(self.num_speculative_tokens)
            and 1 <= self.num_speculative_tokens <= MAX_NUM_SPECULATIVE_TOKENS,
            "speculative.num_speculative_tokens",
            self.num_speculative_tokens,
            f"an integer in [1, {MAX_NUM_SPECULATIVE_TOKENS}] with method {self.method!r}, like "
            f"{_SPECULATIVE_EXAMPLE}",
        )
        is_draft_model = self.method == "draft_model"
        check(
            (isinstance(self.model, str) and bool(self.model)) == is_draft_model,
            "speculative.model",
            self.model,
            "a GGUF file or Hugging Face folder with method 'draft_model' (and only with it)",
        )
        check(
            self.quantization is None
            or (is_draft_model and self.quantization in QUANTIZATION_METHODS),
            "speculative.quantization",
            self.quantization,
            f"None or one of {list(QUANTIZATION_METHODS)} with method 'draft_model'",
        )
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            check(is_int(value) and value >= 1, f"speculative.{name}", value, "an integer >= 1")
        check(
            self.prompt_lookup_min <= self.prompt_lookup_max,
            "speculative.prompt_lookup_min",
            self.prompt_lookup_min,
            f"at most prompt_lookup_max ({self.prompt_lookup_max})",
        )

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots a request needs after its scheduled tokens, for a draft model's keys and
        values of its drafts (``num_speculative_tokens`` with "draft_model", else 0; vLLM's
        name)."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0
