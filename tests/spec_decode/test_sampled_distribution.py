"""Sampled output keeps the model's distribution end to end: on a tiny random model restricted to
its two most likely tokens per position (``top_k=2``), the first four tokens of many seeded
requests with ngram speculation against as many without, a chi-square test of homogeneity over
the sequences. The model mostly repeats its last token, so drafts are proposed at most steps
and both accepted and rejected. The control, a rejection sampler that accepts every draft,
must fail the same test."""

from __future__ import annotations

import pytest
from spec_utils import (
    AlwaysAccept,
    chi2_critical_001,
    homogeneity,
    sample_sequences,
    save_tiny_repeater,
)

from kiln import LLM

pytestmark = pytest.mark.slow

NUM_SAMPLES = 400
NUM_TOKENS = 4


def test_sampled_sequences_have_the_distribution_of_no_speculation(
    gguf_path: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    folder = save_tiny_repeater(
        tmp_path_factory.mktemp("tiny_dist"), gguf_path, max_position_embeddings=256
    )
    common = dict(dtype="float32", max_model_len=256, max_num_seqs=64, kv_cache_memory=0.1)
    plain = LLM(folder, **common)
    spec = LLM(
        folder,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
        **common,
    )
    prompt = plain.get_tokenizer().encode("The list: one, two, three")

    reference = sample_sequences(plain, prompt, 0, NUM_SAMPLES, NUM_TOKENS)
    t = spec.llm_engine.stats.totals
    got = sample_sequences(spec, prompt, 10_000, NUM_SAMPLES, NUM_TOKENS)
    assert t.spec_num_drafts > 0 and 0 < t.spec_num_accepted_tokens < t.spec_num_draft_tokens
    stat, df = homogeneity(reference, got)
    assert df >= 2, (reference, got)
    assert stat < chi2_critical_001(df), (stat, df, reference, got)
    runner = spec.llm_engine.engine_core.executor.worker.model_runner
    runner.speculator.rejection_sampler = AlwaysAccept()
    stat, df = homogeneity(
        reference, sample_sequences(spec, prompt, 20_000, NUM_SAMPLES, NUM_TOKENS)
    )
    assert stat > chi2_critical_001(df), (stat, df)
