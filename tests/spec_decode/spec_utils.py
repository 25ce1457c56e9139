"""Helpers of the speculative-decoding tests: tiny random models that share the default model's
tokenizer, grammar-bound requests, their check and a record of the drafts their grammars cut,
sampling many seeded requests, and a chi-square test of homogeneity with an always-accepting
rejection sampler as its control."""

from __future__ import annotations

import collections
import json
import pathlib
import re

import jsonschema_rs
import pytest

from kiln import LLM, SamplingParams
from kiln.sampling_params import StructuredOutputsParams
from kiln.scheduler import grammar_waitlist
from kiln.spec_decode.interface import RejectionOutput
from kiln.spec_decode.rejection_sampler import RejectionSampler
from kiln.testing.models import save_tiny_model
from kiln.tokenizer import load_tokenizer

# Chi-square critical values at p = 0.001 by degrees of freedom.
CHI2_CRITICAL_001 = [0, 10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88, 29.59,
                     31.26, 32.91, 34.53, 36.12, 37.70, 39.25]  # fmt: skip


def chi2_critical_001(df: int) -> float:
    """The chi-square critical value at p = 0.001: the table up to 16 degrees of freedom, then
    the Wilson-Hilferty approximation (within 0.5% of the exact value there, a little above)."""
    if df < len(CHI2_CRITICAL_001):
        return CHI2_CRITICAL_001[df]
    z = 3.0902  # the standard normal's 0.999 quantile
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def save_tiny_repeater(
    folder: pathlib.Path, gguf_path: str, seed: int = 0, num_hidden_layers: int = 2, **config
) -> str:
    """A tiny random model with the default model's tokenizer. Small tied weights: it mostly
    repeats its last token, then moves on, so ngram drafts and another such model's drafts are
    often, not always, accepted."""
    tokenizer = load_tokenizer(gguf_path).hf_tokenizer
    config = {"max_position_embeddings": 512, **config}
    return save_tiny_model(
        folder, seed=seed, tokenizer=tokenizer, num_hidden_layers=num_hidden_layers,
        hidden_size=64, intermediate_size=96, initializer_range=0.05, tie_word_embeddings=True,
        **config,
    )  # fmt: skip


def results(llm: LLM, prompts: list, params) -> list[tuple[list[int], str, str | None]]:
    """Each request's output token ids, text and finish reason."""
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [
        (o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outputs
    ]


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
GRAMMARS = [
    # No free white space: a tiny repeating model would repeat it up to max_tokens.
    StructuredOutputsParams(json=PERSON, disable_any_whitespace=True),
    StructuredOutputsParams(regex=r"(ab|cd){2,4} end"),
    StructuredOutputsParams(choice=["yes", "no", "maybe"]),
]
"""A JSON schema, a regex and a choice, each bounded: any model completes them in 60 tokens."""
GRAMMAR_PROMPTS = [
    'Person: {"name": "Ann", "age": 31, "city": "Rome"}. Describe a person as JSON.',
    "Repeat: abcdabcd end. Again: abcdabcd end. Again:",
    "Is the sky green? Answer:",
]
"""The first two hold text to copy: an ngram proposer drafts for them."""


def grammar_params() -> list[SamplingParams]:
    """Greedy requests bound by ``GRAMMARS``, in order."""
    return [SamplingParams(temperature=0, max_tokens=60, structured_outputs=g) for g in GRAMMARS]


def check_obeys_grammars(
    grammars: list[StructuredOutputsParams], outputs: list[tuple[list[int], str, str | None]]
) -> None:
    """Each of ``outputs`` (``results``) is complete and obeys its grammar."""
    for grammar, (_, text, reason) in zip(grammars, outputs, strict=True):
        assert reason == "stop", text
        if grammar.json is not None:
            jsonschema_rs.validate(grammar.json, json.loads(text))
        elif grammar.regex is not None:
            assert re.fullmatch(grammar.regex, text), text
        else:
            assert grammar.choice is not None and text in grammar.choice, text


def check_grammar_outputs(llm: LLM, outputs: list[tuple[list[int], str, str | None]]) -> None:
    """``outputs``: the ``results`` of ``GRAMMAR_PROMPTS`` with ``grammar_params()`` in a batch
    with speculating requests. Each is complete and obeys its grammar, and the same requests
    alone give the same outputs while they speculate (drafts verified, some accepted)."""
    check_obeys_grammars(GRAMMARS, outputs)
    before = spec_counts(llm)
    assert results(llm, GRAMMAR_PROMPTS, grammar_params()) == outputs
    drafts, draft_tokens, accepted = (a - b for a, b in zip(spec_counts(llm), before, strict=True))
    assert drafts > 0 and accepted > 0, (drafts, draft_tokens, accepted)


def record_draft_checks(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """A list that gets ``(proposed, kept)`` for every check of a structured request's drafts
    against its grammar (the offline ``LLM`` runs its engine core in this process)."""
    checks: list[tuple[int, int]] = []
    valid_drafts = grammar_waitlist.valid_drafts

    def recording(matcher, drafts: list[int]) -> list[int]:
        kept = valid_drafts(matcher, drafts)
        checks.append((len(drafts), len(kept)))
        return kept

    monkeypatch.setattr(grammar_waitlist, "valid_drafts", recording)
    return checks


def spec_counts(llm: LLM) -> tuple[int, int, int]:
    """The engine's speculative-decoding counters: drafts, draft tokens, accepted tokens."""
    t = llm.llm_engine.stats.totals
    return t.spec_num_drafts, t.spec_num_draft_tokens, t.spec_num_accepted_tokens


class AlwaysAccept(RejectionSampler):
    def forward(self, logits, metadata, draft_token_ids, draft_probs) -> RejectionOutput:
        out = super().forward(logits, metadata, draft_token_ids, draft_probs)
        is_draft = draft_token_ids >= 0
        return RejectionOutput(out.token_ids.where(~is_draft, draft_token_ids), is_draft)


def sample_sequences(
    llm: LLM, prompt: list[int], seed: int, num_samples: int, num_tokens: int
) -> collections.Counter:
    """The first ``num_tokens`` tokens of ``num_samples`` requests seeded ``seed``, ``seed + 1``,
    ... (temperature 1, the two most likely tokens per position), counted."""
    params = [
        SamplingParams(temperature=1.0, top_k=2, seed=seed + i, max_tokens=num_tokens)
        for i in range(num_samples)
    ]
    outputs = llm.generate([prompt] * num_samples, params, use_tqdm=False)
    return collections.Counter(tuple(o.outputs[0].token_ids) for o in outputs)


def homogeneity(a: collections.Counter, b: collections.Counter) -> tuple[float, int]:
    """Chi-square statistic and degrees of freedom of two samples' counts over the same cells;
    cells expected below 5 in either sample are pooled into one."""
    cells = sorted(set(a) | set(b))
    n_a, n_b = sum(a.values()), sum(b.values())
    rows: list[tuple[int, int]] = []
    pooled = [0, 0]
    for cell in cells:
        total = a[cell] + b[cell]
        if total * min(n_a, n_b) / (n_a + n_b) < 5:
            pooled[0] += a[cell]
            pooled[1] += b[cell]
        else:
            rows.append((a[cell], b[cell]))
    if sum(pooled):
        rows.append((pooled[0], pooled[1]))
    stat = 0.0
    for x, y in rows:
        total = x + y
        for observed, n in ((x, n_a), (y, n_b)):
            expected = total * n / (n_a + n_b)
            stat += (observed - expected) ** 2 / expected
    return stat, len(rows) - 1
