"""Sampled output keeps the model's distribution end to end: on a tiny random model restricted to
its two most likely tokens per position (``top_k=2``), the first four tokens of many seeded
requests with ngram speculation against as many without, a chi-square test of homogeneity over
the sequences. The model mostly repeats its last token, so drafts are proposed at most steps
and both accepted and rejected. The control, a rejection sampler that accepts every draft,
must fail the same test."""

from __future__ import annotations

import collections

import pytest

from kiln import LLM, SamplingParams
from kiln.spec_decode.interface import RejectionOutput
from kiln.spec_decode.rejection_sampler import RejectionSampler
from kiln.testing.models import save_tiny_model
from kiln.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow

NUM_SAMPLES = 400
NUM_TOKENS = 4
# Chi-square critical values at p = 0.001 by degrees of freedom.
CHI2_CRITICAL_001 = [0, 10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88, 29.59,
                     31.26, 32.91, 34.53, 36.12, 37.70, 39.25]  # fmt: skip


class AlwaysAccept(RejectionSampler):
    def forward(self, logits, metadata, draft_token_ids, draft_probs) -> RejectionOutput:
        out = super().forward(logits, metadata, draft_token_ids, draft_probs)
        is_draft = draft_token_ids >= 0
        return RejectionOutput(out.token_ids.where(~is_draft, draft_token_ids), is_draft)


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


def test_sampled_sequences_have_the_distribution_of_no_speculation(
    gguf_path: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    folder = save_tiny_model(
        tmp_path_factory.mktemp("tiny_dist"),
        tokenizer=load_tokenizer(gguf_path).hf_tokenizer,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        max_position_embeddings=256,
        # Small tied weights: the model mostly repeats its last token (the ngram draft), so
        # drafts are proposed at most steps, and accepted or not by the draw.
        initializer_range=0.05,
        tie_word_embeddings=True,
    )
    common = dict(dtype="float32", max_model_len=256, max_num_seqs=64, kv_cache_memory=0.1)
    plain = LLM(folder, **common)
    spec = LLM(
        folder,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
        **common,
    )
    prompt = plain.get_tokenizer().encode("The list: one, two, three")

    def sample(llm: LLM, offset: int) -> collections.Counter:
        params = [
            SamplingParams(temperature=1.0, top_k=2, seed=offset + i, max_tokens=NUM_TOKENS)
            for i in range(NUM_SAMPLES)
        ]
        outputs = llm.generate([prompt] * NUM_SAMPLES, params, use_tqdm=False)
        return collections.Counter(tuple(o.outputs[0].token_ids) for o in outputs)

    reference = sample(plain, 0)
    t = spec.llm_engine.stats.totals
    got = sample(spec, 10_000)
    assert t.spec_num_drafts > 0 and 0 < t.spec_num_accepted_tokens < t.spec_num_draft_tokens
    stat, df = homogeneity(reference, got)
    assert df >= 2, (reference, got)
    assert stat < CHI2_CRITICAL_001[df], (stat, df, reference, got)
    runner = spec.llm_engine.engine_core.executor.worker.model_runner
    runner.speculator.rejection_sampler = AlwaysAccept()
    stat, df = homogeneity(reference, sample(spec, 20_000))
    assert stat > CHI2_CRITICAL_001[df], (stat, df)
