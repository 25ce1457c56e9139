"""The real ``ModelRunner`` with chunked prefill: through ``LLM(max_num_batched_tokens=16)`` every
prompt below is split over several steps, and shares each step's 16 tokens with the others. Its
outputs must equal a whole prefill's and ``transformers``' (float32): greedy tokens, seeded tokens
(a partial row must not advance its generator) and prompt logprobs gathered across chunks."""

from __future__ import annotations

import pytest

from kiln import LLM, SamplingParams

pytestmark = pytest.mark.slow

BUDGET = 16
PROMPTS = [
    (
        "The quick brown fox jumps over the lazy dog. In a small village by the river, where the "
        "mill turned day and night and the bakers rose before dawn, there lived"
    ),
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "List three colors and three animals, one per line, and say which animal likes which color:",
    "Once upon a time, in a land far away, a young girl named Alice found a key that",
]
NUM_TOKENS = 12


@pytest.fixture(scope="module")
def chunked_llm(gguf_path: str) -> LLM:
    # No prefix caching: every prompt must really be computed chunk by chunk.
    return LLM(
        gguf_path,
        dtype="float32",
        kv_cache_memory=0.25,
        max_model_len=1024,
        max_num_seqs=8,
        max_num_batched_tokens=BUDGET,
        enable_prefix_caching=False,
    )


def test_prompts_need_several_chunks(chunked_llm):
    tokenizer = chunked_llm.get_tokenizer()
    assert all(len(tokenizer.encode(p)) > BUDGET for p in PROMPTS)
    # Together they need several steps' budgets, so chunks of different requests share steps.
    assert sum(len(tokenizer.encode(p)) for p in PROMPTS) > 4 * BUDGET


def test_greedy_and_prompt_logprobs_match_whole_prefill_and_transformers(
    chunked_llm, llm_f32, hf_model, hf_ref
):
    params = SamplingParams(
        temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, prompt_logprobs=2
    )
    chunked = chunked_llm.generate(PROMPTS, params, use_tqdm=False)
    whole = llm_f32.generate(PROMPTS, params, use_tqdm=False)
    for got, base in zip(chunked, whole, strict=True):
        prompt_ids = got.prompt_token_ids
        expected = hf_ref.greedy(hf_model, prompt_ids, NUM_TOKENS)
        assert got.outputs[0].token_ids == expected, got.prompt
        assert base.outputs[0].token_ids == expected, got.prompt
        assert got.outputs[0].text == base.outputs[0].text
        reference = hf_ref.logprobs(hf_model, prompt_ids)
        assert got.prompt_logprobs is not None and got.prompt_logprobs[0] is None
        assert len(got.prompt_logprobs) == len(prompt_ids)
        for p in range(1, len(prompt_ids)):
            where = f"{got.prompt!r} prompt token {p}"
            hf_ref.check_position(got.prompt_logprobs[p], reference[p - 1], prompt_ids[p], 2, where)


def test_seeded_sampling_matches_whole_prefill(chunked_llm, llm_f32):
    params = [
        SamplingParams(temperature=1.0, seed=100 + i, max_tokens=NUM_TOKENS, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    chunked = chunked_llm.generate(PROMPTS, params, use_tqdm=False)
    whole = llm_f32.generate(PROMPTS, params, use_tqdm=False)
    for got, base in zip(chunked, whole, strict=True):
        assert got.outputs[0].token_ids == base.outputs[0].token_ids, got.prompt
    # Seeds matter: a different seed gives a different text for at least one prompt.
    other = [SamplingParams(temperature=1.0, seed=7, max_tokens=NUM_TOKENS, ignore_eos=True)]
    reseeded = chunked_llm.generate(PROMPTS, other * len(PROMPTS), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in reseeded] != [o.outputs[0].token_ids for o in chunked]
