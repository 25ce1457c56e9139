"""Logprob values served by a real ``kiln serve`` (float32) against ``transformers`` (float32
``log_softmax`` of its logits), through the official ``openai`` client: completion logprobs of the
sampled tokens and their top-k, ``echo`` + ``logprobs`` (prompt logprobs, as lm-eval reads them),
vLLM's ``prompt_logprobs``, and chat ``logprobs`` / ``top_logprobs``."""

from __future__ import annotations

from collections import defaultdict

import httpx
import openai
import pytest
import torch

from kiln.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox jumps over the lazy dog. In a small village by the river, there lived"
NUM_TOP = 3
NUM_TOKENS = 6
LOGPROB_ATOL = 2e-3  # as the root conftest's check (float32 on both sides differ by ~2e-5)


@pytest.fixture(scope="module")
def tokenizer(gguf_path: str):
    return load_tokenizer(gguf_path)


def _check_top(got: dict[str, float], row: torch.Tensor, token_id: int, tokenizer, where: str):
    """``got`` (token text -> logprob, OpenAI's ``top_logprobs`` entry) against the reference row:
    the chosen token and the top ``NUM_TOP``. Different ids may share a text (a dict keeps one)."""
    expected: dict[str, list[float]] = defaultdict(list)
    for tid in {token_id, *row.topk(NUM_TOP).indices.tolist()}:
        expected[tokenizer.decode([tid])].append(float(row[tid]))
    assert set(got) == set(expected), where
    for text, logprob in got.items():
        assert min(abs(logprob - e) for e in expected[text]) <= LOGPROB_ATOL, (where, text)


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.5, "seed": 5}])
def test_echo_and_completion_logprobs_match_transformers(
    client: openai.OpenAI, model_name: str, hf_model, hf_ref, tokenizer, sampling
) -> None:
    completion = client.completions.create(
        model=model_name,
        prompt=PROMPT,
        max_tokens=NUM_TOKENS,
        logprobs=NUM_TOP,
        echo=True,
        extra_body={"return_token_ids": True, "ignore_eos": True},
        **sampling,
    )
    choice = completion.choices[0]
    extra = choice.model_extra or {}
    prompt_ids, token_ids = extra["prompt_token_ids"], extra["token_ids"]
    assert len(token_ids) == NUM_TOKENS
    ids = prompt_ids + token_ids
    reference = hf_ref.logprobs(hf_model, ids)
    lp = choice.logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.token_logprobs) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for p in range(1, len(ids)):
        where = f"{sampling} position {p} of {len(prompt_ids)} prompt tokens"
        expected = float(reference[p - 1, ids[p]])
        assert lp.token_logprobs[p] == pytest.approx(expected, abs=LOGPROB_ATOL), where
        _check_top(lp.top_logprobs[p], reference[p - 1], ids[p], tokenizer, where)
        if sampling["temperature"] == 0 and p >= len(prompt_ids):
            assert ids[p] == int(reference[p - 1].argmax()), where


def test_prompt_logprobs_extra_match_transformers(http: httpx.Client, hf_model, hf_ref) -> None:
    body = {"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": NUM_TOP, "return_token_ids": True}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    prompt_ids = choice["prompt_token_ids"]
    reference = hf_ref.logprobs(hf_model, prompt_ids)
    positions = choice["prompt_logprobs"]
    assert len(positions) == len(prompt_ids) and positions[0] is None
    for p in range(1, len(prompt_ids)):
        row = reference[p - 1]
        expected_ids = {prompt_ids[p], *row.topk(NUM_TOP).indices.tolist()}
        assert {int(t) for t in positions[p]} == expected_ids, p
        for tid, entry in positions[p].items():
            assert entry["logprob"] == pytest.approx(float(row[int(tid)]), abs=LOGPROB_ATOL), p


def test_chat_logprobs_match_transformers(
    client: openai.OpenAI, http: httpx.Client, model_name: str, hf_model, hf_ref, tokenizer
) -> None:
    messages = [{"role": "user", "content": "Name a color."}]
    prompt_ids = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    expected_ids = hf_ref.greedy(hf_model, prompt_ids, 4)
    response = client.chat.completions.create(
        model=model_name,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=NUM_TOP,
        extra_body={"ignore_eos": True},
    )
    content = response.choices[0].logprobs.content
    assert content is not None and len(content) == len(expected_ids)
    reference = hf_ref.logprobs(hf_model, prompt_ids + expected_ids)
    for i, (entry, token_id) in enumerate(zip(content, expected_ids, strict=True)):
        row = reference[len(prompt_ids) - 1 + i]
        assert entry.token == tokenizer.decode([token_id]), i
        assert entry.logprob == pytest.approx(float(row[token_id]), abs=LOGPROB_ATOL), i
        top = {t.token: t.logprob for t in entry.top_logprobs}
        assert len(entry.top_logprobs) == NUM_TOP
        expected_top = row.topk(NUM_TOP)
        got_values = sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert got_values == pytest.approx(expected_top.values.tolist(), abs=LOGPROB_ATOL), i
        assert set(top) == {tokenizer.decode([t]) for t in expected_top.indices.tolist()}, i
