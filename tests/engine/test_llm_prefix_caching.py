"""Prefix caching changes nothing but speed: the same prompts, sharing a long prefix and sent over
several ``generate`` calls (so later calls hit blocks cached by earlier ones), give the same tokens
and logprobs with ``enable_prefix_caching`` on and off. The hits are asserted through the engine's
stats and ``RequestOutput.num_cached_tokens``."""

from __future__ import annotations

import os

import pytest

from kiln import LLM, SamplingParams

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16  # the default
PREFIX = (
    "You are a careful assistant at the kiln museum. Visitors ask about pottery, glazes, firing "
    "temperatures and the history of the building, which was a brick works until 1962. Answer "
    "briefly and politely, in one or two sentences, and say so when you do not know the answer. "
    "Question: "
)
# Each call: a list of suffixes; a later call repeats a suffix of an earlier one.
CALLS = [
    ["What is a glaze?"],
    ["How hot does the kiln get?", "When was the building a brick works?"],
    ["What is a glaze?", "Can I touch the pots?"],
]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=11, max_tokens=8, logprobs=2, ignore_eos=True),
]


@pytest.fixture(scope="module")
def uncached_llm(gguf_path: str) -> LLM:
    return LLM(
        gguf_path,
        dtype="float32",
        kv_cache_memory=0.25,
        max_model_len=1024,
        max_num_seqs=8,
        enable_prefix_caching=False,
    )


def _run(llm: LLM) -> tuple[list, int]:
    """Outputs of every call in order, and the prefix-cache hits (tokens) they caused."""
    stats = llm.llm_engine.stats.totals
    hits_before = stats.prefix_cache_hits
    outputs = []
    for suffixes in CALLS:
        prompts = [PREFIX + s for s in suffixes for _ in PARAMS]
        outputs += llm.generate(prompts, PARAMS * len(suffixes), use_tqdm=False)
    return outputs, stats.prefix_cache_hits - hits_before


def test_same_outputs_with_and_without_prefix_caching(llm_f32, uncached_llm):
    cached, cached_hits = _run(llm_f32)
    uncached, uncached_hits = _run(uncached_llm)

    # The cache was used: every request after the first call reuses at least the prefix's whole
    # blocks; with caching off nothing is reused.
    shared = os.path.commonprefix([o.prompt_token_ids for o in cached])
    prefix_blocks = len(shared) // BLOCK_SIZE
    assert prefix_blocks >= 3
    later = cached[len(CALLS[0]) * len(PARAMS) :]
    assert all(o.num_cached_tokens >= prefix_blocks * BLOCK_SIZE for o in later)
    assert all(o.num_cached_tokens % BLOCK_SIZE == 0 for o in cached)
    assert cached_hits >= sum(o.num_cached_tokens for o in later) > 0
    assert uncached_hits == 0 and all(o.num_cached_tokens == 0 for o in uncached)

    for got, base in zip(cached, uncached, strict=True):
        assert got.prompt == base.prompt
        a, b = got.outputs[0], base.outputs[0]
        assert a.token_ids == b.token_ids, got.prompt
        assert a.logprobs is not None and b.logprobs is not None
        for pos_a, pos_b in zip(a.logprobs, b.logprobs, strict=True):
            assert set(pos_a) == set(pos_b), got.prompt
            for token_id, logprob in pos_a.items():
                assert logprob.logprob == pytest.approx(pos_b[token_id].logprob, abs=2e-3)
