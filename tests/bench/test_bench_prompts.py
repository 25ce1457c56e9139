"""Synthetic benchmark prompts: seeded, distinct, calibrated to a token count."""

import asyncio

import pytest

from kiln.bench.prompts import WORDS, make_prompts


def test_without_a_counter_one_word_per_token():
    prompts = asyncio.run(make_prompts(5, 32, seed=1))
    assert len(prompts) == 5
    assert all(len(p.text.split()) == 32 and p.num_tokens == 32 for p in prompts)
    assert not any(p.is_calibrated for p in prompts)
    assert len({p.text for p in prompts}) == 5
    assert all(word in WORDS for word in prompts[0].text.split())


def test_same_seed_same_prompts_other_seed_others():
    a = asyncio.run(make_prompts(3, 16, seed=7))
    b = asyncio.run(make_prompts(3, 16, seed=7))
    c = asyncio.run(make_prompts(3, 16, seed=8))
    assert [p.text for p in a] == [p.text for p in b]
    assert [p.text for p in a] != [p.text for p in c]


def test_calibration_reaches_the_exact_count():
    # A tokenizer where long words are two tokens, plus a BOS: words alone would miss the target.
    async def count(text: str) -> int:
        return 1 + sum(2 if len(w) > 4 else 1 for w in text.split())

    prompts = asyncio.run(make_prompts(8, 50, seed=3, count_tokens=count))
    for p in prompts:
        assert p.is_calibrated
        assert p.num_tokens == 50
        assert asyncio.run(count(p.text)) == 50


def test_a_counter_that_cannot_count_falls_back_to_the_estimate():
    async def count(text: str) -> None:
        return None

    prompts = asyncio.run(make_prompts(2, 10, count_tokens=count))
    assert [p.num_tokens for p in prompts] == [10, 10]
    assert not prompts[0].is_calibrated


@pytest.mark.parametrize("num_prompts, input_len", [(0, 10), (2, 0)])
def test_rejects_empty_sizes(num_prompts, input_len):
    with pytest.raises(ValueError):
        asyncio.run(make_prompts(num_prompts, input_len))
