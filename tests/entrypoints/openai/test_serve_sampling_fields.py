"""The request -> ``SamplingParams`` mapping of a real ``kiln serve`` (float32), field by field,
with requests whose outputs change when a field is lost or swapped: ``presence_penalty`` and
``frequency_penalty`` (on a repetitive prompt, each gives a different greedy text), ``min_tokens``
(a prompt whose answer otherwise ends at EOS after 5 tokens), ``min_p`` (``min_p=1`` keeps only
the most likely token, so a hot, seeded request decodes greedily), and vLLM's
``allowed_token_ids``, ``bad_words`` and ``truncate_prompt_tokens``. The expected tokens come from
``transformers`` with the penalties and masks applied here, by OpenAI's and vLLM's definitions."""

from __future__ import annotations

from collections.abc import Sequence

import httpx
import pytest
import torch

pytestmark = pytest.mark.slow

EOS = 2  # <|im_end|>, the default model's EOS


def _reference(
    hf_model: torch.nn.Module,
    prompt_ids: Sequence[int],
    max_tokens: int,
    *,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    min_tokens: int = 0,
    stop_at_eos: bool = False,
    allowed: Sequence[int] | None = None,
    bad_sequences: Sequence[Sequence[int]] = (),
) -> list[int]:
    """Greedy decoding with OpenAI's penalties (on output tokens: ``logit -= frequency * count +
    presence * (count > 0)``), EOS masked while fewer than ``min_tokens`` tokens exist, only
    ``allowed`` tokens, and no token that would complete one of ``bad_sequences``."""
    tokens: list[int] = []
    with torch.inference_mode():
        while len(tokens) < max_tokens:
            logits = hf_model(torch.tensor([[*prompt_ids, *tokens]])).logits[0, -1].float()
            counts = torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=len(logits))
            logits -= frequency_penalty * counts + presence_penalty * (counts > 0)
            if len(tokens) < min_tokens:
                logits[EOS] = float("-inf")
            if allowed is not None:
                keep = logits[list(allowed)].clone()
                logits[:] = float("-inf")
                logits[list(allowed)] = keep
            for bad in bad_sequences:
                if list(bad[:-1]) == tokens[len(tokens) - len(bad) + 1 :] or len(bad) == 1:
                    logits[bad[-1]] = float("-inf")
            tokens.append(int(logits.argmax()))
            if stop_at_eos and tokens[-1] == EOS:
                break
    return tokens


def _strip_eos(token_ids: list[int]) -> list[int]:
    return token_ids[:-1] if token_ids and token_ids[-1] == EOS else token_ids


def _complete(http: httpx.Client, prompt: str | list[int], **fields: object) -> dict:
    body = {"prompt": prompt, "return_token_ids": True, **fields}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_presence_and_frequency_penalties_are_not_swapped(http: httpx.Client, hf_model) -> None:
    prompt = "Repeat after me: one one one one one one"
    common = {"temperature": 0, "max_tokens": 16, "ignore_eos": True}
    presence = _complete(http, prompt, presence_penalty=1.0, **common)
    frequency = _complete(http, prompt, frequency_penalty=1.0, **common)
    prompt_ids = presence["prompt_token_ids"]
    assert presence["token_ids"] == _reference(hf_model, prompt_ids, 16, presence_penalty=1.0)
    assert frequency["token_ids"] == _reference(hf_model, prompt_ids, 16, frequency_penalty=1.0)
    # The two differ, so a swap (or a penalty dropped) cannot pass both lines above.
    assert presence["token_ids"] != frequency["token_ids"]


def test_min_tokens_holds_back_eos(http: httpx.Client, hf_model) -> None:
    messages = [{"role": "user", "content": "Reply with one word: is fire hot?"}]
    prompt_ids = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    short = _complete(http, prompt_ids, temperature=0, max_tokens=40)
    assert short["finish_reason"] == "stop" and len(short["token_ids"]) < 12  # EOS comes early
    held = _complete(http, prompt_ids, temperature=0, max_tokens=40, min_tokens=12)
    expected = _reference(hf_model, prompt_ids, 40, min_tokens=12, stop_at_eos=True)
    assert len(_strip_eos(held["token_ids"])) >= 12
    assert _strip_eos(held["token_ids"]) == _strip_eos(expected)


def test_min_p_one_keeps_only_the_most_likely_token(http: httpx.Client, hf_model, hf_ref) -> None:
    prompt = "The capital of France is"
    hot = {"temperature": 5.0, "seed": 1, "max_tokens": 8, "ignore_eos": True}
    kept = _complete(http, prompt, min_p=1.0, **hot)
    expected = hf_ref.greedy(hf_model, kept["prompt_token_ids"], 8)
    assert kept["token_ids"] == expected
    # Without min_p the same hot request wanders off: dropping the field would show.
    assert _complete(http, prompt, **hot)["token_ids"] != expected


def test_allowed_token_ids_restrict_every_token(http: httpx.Client, hf_model) -> None:
    prompt = "The capital of France is"
    free = _complete(http, prompt, temperature=0, max_tokens=8, ignore_eos=True)
    # The free answer's tokens but its first, plus a few others: the answer must change.
    allowed = sorted(set(free["token_ids"][1:]) | {13, 28, 314, 1345})
    kept = _complete(
        http, prompt, temperature=0, max_tokens=8, ignore_eos=True, allowed_token_ids=allowed
    )
    assert set(kept["token_ids"]) <= set(allowed)
    assert kept["token_ids"] == _reference(hf_model, kept["prompt_token_ids"], 8, allowed=allowed)
    assert kept["token_ids"] != free["token_ids"]


def test_bad_words_are_never_generated(http: httpx.Client, hf_model) -> None:
    prompt = "The capital of France is"
    free = _complete(http, prompt, temperature=0, max_tokens=12, ignore_eos=True)
    assert "Paris" in free["text"]
    banned = _complete(
        http, prompt, temperature=0, max_tokens=12, ignore_eos=True, bad_words=["Paris"]
    )
    assert "Paris" not in banned["text"]
    sequences = []
    for text in ("Paris", " Paris"):
        ids = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
        sequences.append(ids.json()["tokens"])
    expected = _reference(hf_model, banned["prompt_token_ids"], 12, bad_sequences=sequences)
    assert banned["token_ids"] == expected


def test_truncate_prompt_tokens_keeps_the_last_tokens(http: httpx.Client, hf_model) -> None:
    prompt_ids = http.post("/tokenize", json={"prompt": "Once upon a time, in a land far away,"})
    prompt_ids = prompt_ids.json()["tokens"]
    body = {"temperature": 0, "max_tokens": 6, "ignore_eos": True, "truncate_prompt_tokens": 4}
    response = http.post("/v1/completions", json={"prompt": prompt_ids, **body})
    assert response.json()["usage"]["prompt_tokens"] == 4
    choice = _complete(http, prompt_ids, return_token_ids=True, **body)
    assert choice["prompt_token_ids"] == prompt_ids[-4:]
    assert choice["token_ids"] == _reference(hf_model, prompt_ids[-4:], 6)
    for value in (0, -5):
        refused = http.post(
            "/v1/completions", json={"prompt": "Hi", "truncate_prompt_tokens": value}
        )
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "truncate_prompt_tokens"
