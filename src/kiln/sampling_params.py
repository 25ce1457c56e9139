"""Per-request sampling parameters, with vLLM's field names, defaults and meanings.

Contract: a ``SamplingParams`` is a plain dataclass of plain values (ints, floats, strings, lists,
dicts, a set and two ``IntEnum`` s), so it pickles and round-trips through msgspec unchanged, and it
is validated once, in ``__post_init__``: every invalid value raises ``ValueError`` naming the field,
the value and the allowed range. After construction the params are normalised: ``stop`` and
``stop_token_ids`` are lists, ``top_k`` is 0 when off, and a greedy request (``temperature``
below ``SAMPLING_EPS``) has its ``top_p`` / ``top_k`` / ``min_p`` reset to "off", so batched filters
see no work for it.

What it must not know: tokenizers and models. The one model fact it takes is the EOS token id, which
the input processor passes in through ``update_from_generation_config`` (so that ``min_tokens`` can
mask EOS and a generation config's extra EOS ids stop generation). Limits that depend on the server
(``max_logprobs``) or on the model (vocabulary size, context length) are checked by the caller;
``verify_max_logprobs`` is the helper for the first.
"""

from __future__ import annotations

import copy
import enum
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Below this temperature a request is greedy (argmax); dividing by it would overflow.
SAMPLING_EPS = 1e-5

_MAX_PENALTY = 2.0
_MAX_LOGIT_BIAS = 100.0
MAX_STOP_CHARS = 2**16
"""The most characters all of a request's stop strings may hold together."""
MAX_ALLOWED_TOKEN_IDS = 2**18
"""The most ``allowed_token_ids``: more than any vocabulary Kiln serves."""
MAX_BAD_WORDS = 256
"""The most ``bad_words`` a request may give (each one is checked on every step)."""
MAX_BAD_WORD_CHARS = 256
"""The longest bad word."""


MAX_STRUCTURED_OUTPUT_CHARS = 2**17
"""The most characters a structured-output spec (a schema as JSON text, a regex, a grammar, or
all choices together) may hold: bigger specs are refused before compiling (hostile input)."""


@dataclass
class StructuredOutputsParams:
    """What the output must match, enforced while sampling (vLLM's ``StructuredOutputsParams``).

    Exactly one of ``json``, ``regex``, ``choice``, ``grammar`` and ``json_object`` is set (vLLM's
    ``structural_tag`` is not supported). This class checks the form only (types, sizes, exactly
    one kind); whether a schema, regex or grammar compiles is checked by
    ``kiln.structured_output`` when the request is admitted, with a ``ValueError`` naming the
    field.

    Raises:
        ValueError: from the constructor, when no kind or several are set, a field has the wrong
            type or is empty, or the spec is larger than ``MAX_STRUCTURED_OUTPUT_CHARS``.
    """

    json: str | dict[str, Any] | None = None
    """A JSON schema (a dict, or its JSON text) the output must validate against."""
    regex: str | None = None
    """A regular expression the whole output must match."""
    choice: list[str] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """A grammar in EBNF (GBNF / Lark form, as the backend reads it) the output must match."""
    json_object: bool | None = None
    """True: the output is any JSON object (``response_format`` ``{"type": "json_object"}``)."""
    disable_any_whitespace: bool = False
    """JSON without whitespace between tokens (no newlines or indentation)."""
    disable_additional_properties: bool = False
    """Treat JSON objects as ``"additionalProperties": false`` where the schema does not say."""

    def __post_init__(self) -> None:
        if self.choice is not None:
            self.choice = (
                list(self.choice) if isinstance(self.choice, (list, tuple)) else self.choice
            )
        if self.json_object is False:
            self.json_object = None
        kinds = [name for name in STRUCTURED_OUTPUT_KINDS if getattr(self, name) is not None]
        if len(kinds) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of "
                f"{', '.join(STRUCTURED_OUTPUT_KINDS)}, got "
                f"{', '.join(kinds) if kinds else 'none'}"
            )
        kind = kinds[0]
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as e:
                    raise _invalid("structured_outputs.json", "a JSON schema", self.json) from e
            if not isinstance(value, dict):
                raise _invalid("structured_outputs.json", "a JSON schema (object)", self.json)
            num_chars = len(json.dumps(value))
        elif kind == "choice":
            if (
                not isinstance(value, list)
                or not value
                or not all(isinstance(c, str) and c for c in value)
            ):
                raise _invalid("structured_outputs.choice", "a list of non-empty strings", value)
            num_chars = sum(len(c) for c in value)
        elif kind == "json_object":
            if value is not True:
                raise _invalid("structured_outputs.json_object", "true", value)
            num_chars = 0
        else:
            if not isinstance(value, str) or not value:
                raise _invalid(f"structured_outputs.{kind}", "a non-empty string", value)
            num_chars = len(value)
        if num_chars > MAX_STRUCTURED_OUTPUT_CHARS:
            raise ValueError(
                f"structured_outputs.{kind} must hold at most {MAX_STRUCTURED_OUTPUT_CHARS} "
                f"characters, got {num_chars}"
            )
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise _invalid(f"structured_outputs.{name}", "a boolean", getattr(self, name))

    @property
    def kind(self) -> str:
        """Which constraint is set: one of ``STRUCTURED_OUTPUT_KINDS``."""
        return next(name for name in STRUCTURED_OUTPUT_KINDS if getattr(self, name) is not None)

    @property
    def spec(self) -> str:
        """The constraint as text (a schema as canonical JSON): with ``kind``, the cache key."""
        value = getattr(self, self.kind)
        if self.kind == "json":
            value = json.loads(value) if isinstance(value, str) else value
            return json.dumps(value, sort_keys=True, separators=(",", ":"))
        if self.kind == "choice":
            return json.dumps(value)
        return "" if self.kind == "json_object" else value

    @property
    def key(self) -> tuple[str, str, bool, bool]:
        """What identifies the compiled grammar: ``(kind, spec, *json options)``."""
        return (
            self.kind,
            self.spec,
            self.disable_any_whitespace,
            self.disable_additional_properties,
        )


STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")
"""The kinds of constraint ``StructuredOutputsParams`` holds, one per request."""


class SamplingType(enum.IntEnum):
    """How the sampler picks a request's token."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


class RequestOutputKind(enum.IntEnum):
    """What each ``RequestOutput`` of a request carries (as vLLM's)."""

    CUMULATIVE = 0
    """Everything generated so far, every time."""
    DELTA = 1
    """Only what is new since the previous output."""
    FINAL_ONLY = 2
    """One output, when the request finishes."""


def _invalid(name: str, allowed: str, value: Any) -> ValueError:
    return ValueError(f"{name} must be {allowed}, got {value!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """How to sample the completion of one prompt. Field names and defaults follow vLLM.

    Raises:
        ValueError: from the constructor, for any value outside its allowed range; the message names
            the field, the value and the range.
    """

    n: int = 1
    """Number of completions to return for the prompt."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token already generated; in [-2, 2]."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it was generated; in [-2, 2]."""
    repetition_penalty: float = 1.0
    """Divides positive / multiplies negative logits of tokens seen in the prompt or output; > 0."""
    temperature: float = 1.0
    """Softmax temperature; below ``SAMPLING_EPS`` (e.g. 0) means greedy."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose probabilities reach ``top_p``; (0, 1]."""
    top_k: int = 0
    """Keep the ``top_k`` most likely tokens; 0 or -1 turns it off (stored as 0)."""
    min_p: float = 0.0
    """Drop tokens whose probability is below ``min_p`` times the top token's; in [0, 1]."""
    seed: int | None = None
    """Seed of the request's own random generator: its draws do not depend on other requests.

    Same seed (or greedy), same tokens, holds bit for bit whatever else is in the batch only in
    batch-invariant mode (``--batch-invariant``, ``LLM(batch_invariant=True)``; cpu platform:
    bfloat16) and only while the prompt is computed in one step without a prefix-cache hit and the
    request is not preempted (chunked, cached and recomputed prompts take other attention paths).
    Otherwise the logits' low bits depend on the batch: in bfloat16 (the cpu default where the CPU
    has bf16) that changes tokens (8 of 32 greedy prompts run together differed from their runs
    alone); in float32 the differences are tiny (32 of 32 equal) but not zero, so a near-tie can
    still flip. On one machine, with the same threads and versions, a run repeats exactly."""
    stop: str | list[str] | None = None
    """Strings that end generation when generated (not included unless asked); a list after init."""
    stop_token_ids: list[int] | None = None
    """Token ids that end generation (included in the output tokens); a list after init."""
    ignore_eos: bool = False
    """Keep generating after EOS."""
    max_tokens: int | None = 16
    """Most tokens to generate; None: up to the model's context length."""
    min_tokens: int = 0
    """Fewest tokens to generate before EOS or ``stop_token_ids`` may end generation."""
    logprobs: int | None = None
    """Number of top logprobs to return per generated token, besides the sampled token's."""
    prompt_logprobs: int | None = None
    """Number of top logprobs to return per prompt token, besides the prompt token's."""
    detokenize: bool = True
    """Produce text; False returns token ids only (stop strings then can't work)."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the text."""
    spaces_between_special_tokens: bool = True
    """Put spaces between special tokens in the text."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string at the end of the text."""
    logit_bias: dict[int, float] | None = None
    """Token id -> value added to its logit before sampling, in [-100, 100]; keys may be strings."""
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    """What each output of the request carries."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, regex, choice or grammar (a dict is taken as the
    ``StructuredOutputsParams`` fields). EOS is allowed only where the constraint is complete."""

    allowed_token_ids: list[int] | None = None
    """Only these token ids may be sampled (at most ``MAX_ALLOWED_TOKEN_IDS``, in the vocabulary;
    deduplicated and sorted after init)."""
    bad_words: list[str] | None = None
    """Words never generated (at most ``MAX_BAD_WORDS`` of at most ``MAX_BAD_WORD_CHARS``
    characters): each is tokenized as written and after a space, and the last token of either is
    masked wherever the output so far ends with the tokens before it."""
    truncate_prompt_tokens: int | None = None
    """Keep only the prompt's last ``k`` tokens (``k >= 1``); -1 keeps the last
    ``max_model_len``; None keeps it whole."""
    extra_args: dict[str, Any] | None = None
    """What plugins read (vLLM's ``extra_args``): ``{"kv_transfer_params": {...}}`` is what the
    client asked of the KV connector (``kiln.kv_transfer.params``)."""

    # Stop token ids plus every EOS id (even with ignore_eos): what min_tokens masks. Filled from
    # stop_token_ids here and from the model in update_from_generation_config.
    _all_stop_token_ids: set[int] = field(default_factory=set, repr=False)
    # ``bad_words`` as token-id sequences (``update_from_tokenizer``).
    _bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            self.logit_bias = self._parse_logit_bias(self.logit_bias)
        if not isinstance(self.output_kind, RequestOutputKind):
            self.output_kind = RequestOutputKind(self.output_kind)
        if isinstance(self.structured_outputs, dict):
            unknown = set(self.structured_outputs) - set(
                StructuredOutputsParams.__dataclass_fields__
            )
            if unknown:
                raise _invalid(
                    "structured_outputs keys",
                    f"in {sorted(StructuredOutputsParams.__dataclass_fields__)}",
                    sorted(unknown),
                )
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        elif not isinstance(self.structured_outputs, (StructuredOutputsParams, type(None))):
            raise _invalid(
                "structured_outputs",
                "None, a StructuredOutputsParams or a dict",
                self.structured_outputs,
            )
        self._verify_args()
        if self.temperature < SAMPLING_EPS:
            # Greedy: the filters change nothing, so turn them off (the batch may skip them).
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0
        self._all_stop_token_ids = set(self._all_stop_token_ids)
        self._all_stop_token_ids.update(self.stop_token_ids)

    @staticmethod
    def _parse_logit_bias(logit_bias: dict[Any, Any]) -> dict[int, float]:
        parsed: dict[int, float] = {}
        for token, bias in logit_bias.items():
            try:
                token_id = int(token)
            except (TypeError, ValueError):
                raise _invalid("logit_bias keys", "token ids (integers)", token) from None
            if token_id < 0:
                raise _invalid("logit_bias keys", "token ids >= 0", token)
            if not _is_number(bias) or not -_MAX_LOGIT_BIAS <= bias <= _MAX_LOGIT_BIAS:
                raise _invalid(f"logit_bias[{token_id}]", "in [-100, 100]", bias)
            parsed[token_id] = float(bias)
        return parsed

    def _verify_args(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise _invalid("n", "an integer >= 1", self.n)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -_MAX_PENALTY <= value <= _MAX_PENALTY:
                raise _invalid(name, "in [-2, 2]", value)
        if not _is_number(self.repetition_penalty) or not self.repetition_penalty > 0:
            raise _invalid("repetition_penalty", "> 0", self.repetition_penalty)
        if not _is_number(self.temperature) or not self.temperature >= 0:
            raise _invalid("temperature", ">= 0", self.temperature)
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise _invalid("top_p", "in (0, 1]", self.top_p)
        if not _is_int(self.top_k) or self.top_k < 0:
            raise _invalid("top_k", "0 or -1 (off) or an integer >= 1", self.top_k)
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise _invalid("min_p", "in [0, 1]", self.min_p)
        if self.seed is not None and (not _is_int(self.seed) or not -(2**63) <= self.seed < 2**64):
            raise _invalid("seed", "None or an integer in [-2**63, 2**64)", self.seed)
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise _invalid("max_tokens", "None or an integer >= 1", self.max_tokens)
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise _invalid("min_tokens", "an integer >= 0", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                raise _invalid(name, "None or an integer >= 0", value)
        assert isinstance(self.stop, list) and isinstance(self.stop_token_ids, list)  # normalised
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise _invalid("stop", "non-empty strings", s)
        num_stop_chars = sum(len(s) for s in self.stop)
        if num_stop_chars > MAX_STOP_CHARS:
            raise ValueError(
                f"stop must hold at most {MAX_STOP_CHARS} characters in all, got {num_stop_chars}"
            )
        for token_id in self.stop_token_ids:
            if not _is_int(token_id) or token_id < 0:
                raise _invalid("stop_token_ids", "token ids (integers >= 0)", token_id)
        self._verify_vocabulary_args()

    def _verify_vocabulary_args(self) -> None:
        """``allowed_token_ids``, ``bad_words`` and ``truncate_prompt_tokens``."""
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, list | tuple) or not 1 <= len(ids) <= MAX_ALLOWED_TOKEN_IDS:
                raise _invalid(
                    "allowed_token_ids", f"None or 1 to {MAX_ALLOWED_TOKEN_IDS} token ids", ids
                )
            bad = [t for t in ids if not _is_int(t) or t < 0]
            if bad:
                raise _invalid("allowed_token_ids", "token ids (integers >= 0)", bad[0])
            self.allowed_token_ids = sorted(set(ids))
        if self.bad_words is not None:
            words = self.bad_words
            if not isinstance(words, list | tuple) or len(words) > MAX_BAD_WORDS:
                raise _invalid("bad_words", f"None or a list of at most {MAX_BAD_WORDS}", words)
            for word in words:
                if not isinstance(word, str) or not word.strip() or len(word) > MAX_BAD_WORD_CHARS:
                    raise _invalid(
                        "bad_words",
                        f"non-blank strings of at most {MAX_BAD_WORD_CHARS} chars",
                        word,
                    )
            self.bad_words = list(words)
        k = self.truncate_prompt_tokens
        if k is not None and (not _is_int(k) or (k < 1 and k != -1)):
            raise _invalid("truncate_prompt_tokens", "None, -1 or an integer >= 1", k)
        if self.stop and not self.detokenize:
            raise ValueError(
                f"stop strings need detokenize=True, got detokenize=False and stop={self.stop!r}"
            )

    def verify_max_logprobs(self, max_logprobs: int) -> None:
        """Check ``logprobs`` and ``prompt_logprobs`` against the server's ``max_logprobs``.

        Raises:
            ValueError: either asks for more than ``max_logprobs``.
        """
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > max_logprobs:
                raise _invalid(name, f"<= max_logprobs ({max_logprobs})", value)

    def update_from_generation_config(
        self, generation_config: dict[str, Any], model_eos_token_id: int | None = None
    ) -> None:
        """Take the model's EOS ids (as vLLM's method of the same name).

        ``model_eos_token_id`` (the tokenizer's EOS) joins ``all_stop_token_ids`` only; the
        scheduler stops on it unless ``ignore_eos``. Extra ``eos_token_id`` s of the generation
        config join ``all_stop_token_ids`` and, unless ``ignore_eos``, ``stop_token_ids``.

        Side effects: mutates ``stop_token_ids`` and ``all_stop_token_ids``.
        """
        if model_eos_token_id is not None:
            self._all_stop_token_ids.add(model_eos_token_id)
        eos_ids = generation_config.get("eos_token_id")
        if eos_ids is None:
            return
        extra = {eos_ids} if isinstance(eos_ids, int) else set(eos_ids)
        extra.discard(model_eos_token_id)
        if not extra:
            return
        self._all_stop_token_ids.update(extra)
        if not self.ignore_eos:
            assert self.stop_token_ids is not None
            self.stop_token_ids = sorted(extra.union(self.stop_token_ids))

    def update_from_tokenizer(self, encode: Callable[[str], list[int]]) -> None:
        """Tokenize ``bad_words`` with ``encode`` (text -> ids, no special tokens): each word as
        written and after a space (as it appears mid-text), each distinct sequence once.

        Side effects: sets ``bad_words_token_ids``.
        """
        sequences: list[list[int]] = []
        for word in self.bad_words or []:
            for text in (word, " " + word.lstrip()):
                ids = encode(text)
                if ids and ids not in sequences:
                    sequences.append(ids)
        self._bad_words_token_ids = sequences

    @property
    def bad_words_token_ids(self) -> list[list[int]]:
        """``bad_words`` as token-id sequences (empty before ``update_from_tokenizer``)."""
        return self._bad_words_token_ids

    @property
    def all_stop_token_ids(self) -> set[int]:
        """``stop_token_ids`` plus every EOS id: the ids ``min_tokens`` keeps from being sampled."""
        return self._all_stop_token_ids

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    def clone(self) -> SamplingParams:
        """A deep copy (e.g. for the children of an ``n > 1`` request)."""
        return copy.deepcopy(self)
