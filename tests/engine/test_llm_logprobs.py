"""Logprob values of the offline ``LLM`` (float32) against ``transformers``: sampled tokens (greedy
and seeded), their top-k, and prompt logprobs. The reference is ``log_softmax`` of transformers'
float32 logits at every position of prompt + output."""

from __future__ import annotations

import pytest

from kiln import SamplingParams

pytestmark = pytest.mark.slow

NUM_TOP = 5
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. In a small village by the river, there lived",
    "def fibonacci(n):",
]


def test_sampled_and_top_logprobs_match_transformers(llm_f32, hf_model, hf_ref):
    params = [
        SamplingParams(temperature=0, max_tokens=8, logprobs=NUM_TOP, ignore_eos=True),
        # Logprobs are the model's distribution, not the temperature-scaled one drawn from.
        SamplingParams(temperature=1.5, seed=3, max_tokens=8, logprobs=NUM_TOP, ignore_eos=True),
    ]
    prompts = [p for p in PROMPTS for _ in params]
    outputs = llm_f32.generate(prompts, params * len(PROMPTS), use_tqdm=False)
    for output, param in zip(outputs, params * len(PROMPTS), strict=True):
        completion = output.outputs[0]
        prompt_ids = output.prompt_token_ids
        reference = hf_ref.logprobs(hf_model, prompt_ids + completion.token_ids)
        assert completion.logprobs is not None and len(completion.logprobs) == 8
        for i, (token, position) in enumerate(
            zip(completion.token_ids, completion.logprobs, strict=True)
        ):
            row = reference[len(prompt_ids) - 1 + i]
            where = f"{output.prompt!r} T={param.temperature} token {i}"
            hf_ref.check_position(position, row, token, NUM_TOP, where)
            if param.temperature == 0:
                assert token == int(row.argmax()), where
        rows = reference[len(prompt_ids) - 1 : -1]
        expected_sum = float(rows[range(len(rows)), completion.token_ids].sum())
        assert completion.cumulative_logprob == pytest.approx(expected_sum, abs=8 * 2e-3)


@pytest.mark.parametrize("num_top", [0, 3])
def test_prompt_logprobs_match_transformers(llm_f32, hf_model, hf_ref, num_top):
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=num_top)
    for output in llm_f32.generate(PROMPTS, params, use_tqdm=False):
        prompt_ids = output.prompt_token_ids
        reference = hf_ref.logprobs(hf_model, prompt_ids)
        assert output.prompt_logprobs is not None
        assert len(output.prompt_logprobs) == len(prompt_ids)
        assert output.prompt_logprobs[0] is None  # the first token has nothing to predict it
        for p in range(1, len(prompt_ids)):
            position = output.prompt_logprobs[p]
            assert position is not None
            where = f"{output.prompt!r} prompt token {p}"
            hf_ref.check_position(position, reference[p - 1], prompt_ids[p], num_top, where)
