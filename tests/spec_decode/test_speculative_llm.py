"""Speculative decoding end to end (offline ``LLM``): greedy output token for token as without
speculation, on the real default model in float32 and on a tiny random model; batches that mix
speculating and plain requests (a prompt with nothing to look up; JSON schema, regex and choice
grammars: their outputs valid, their requests speculating too); drafts a JSON schema forbids cut
and the output as without speculation; stop strings,
``max_tokens`` and logprobs cut inside a verified run; preemption while speculating; and the
acceptance counters the metrics read."""

from __future__ import annotations

import json

import jsonschema_rs
import pytest
from spec_utils import (
    GRAMMAR_PROMPTS,
    GRAMMARS,
    PERSON,
    check_grammar_outputs,
    grammar_params,
    record_draft_checks,
    results,
    save_tiny_repeater,
    spec_counts,
)

from kiln import LLM, SamplingParams
from kiln.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.slow

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}
CODE = "def add(a, b):\n    total = a + b\n    print(total)\n    return total\n"
PROMPTS = [
    f"{CODE}\n# The same function again, unchanged:\n",
    "Copy this list: red, green, blue, yellow, purple, orange. Copy: red, green, blue,",
    "The capital of France is",  # little to look up: few or no drafts
    f"{CODE}\n# Now with the name changed to plus:\ndef plus(a, b):\n",
]


@pytest.fixture(scope="module")
def spec_llm(gguf_path: str) -> LLM:
    # The settings of the session's llm_f32, plus speculation.
    return LLM(
        gguf_path,
        dtype="float32",
        kv_cache_memory=0.25,
        max_model_len=1024,
        max_num_seqs=8,
        speculative_config=NGRAM,
    )


def test_greedy_output_is_the_same_token_for_token(spec_llm: LLM, llm_f32: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=40, logprobs=2)
    before = spec_counts(spec_llm)
    spec = spec_llm.generate(PROMPTS, params, use_tqdm=False)
    plain = llm_f32.generate(PROMPTS, params, use_tqdm=False)
    for s, p in zip(spec, plain, strict=True):
        assert s.outputs[0].token_ids == p.outputs[0].token_ids, s.prompt
        assert s.outputs[0].text == p.outputs[0].text
        # One logprobs entry per token, each for that token, as without speculation.
        assert len(s.outputs[0].logprobs) == len(p.outputs[0].logprobs)
        for token_id, s_pos, p_pos in zip(
            s.outputs[0].token_ids, s.outputs[0].logprobs, p.outputs[0].logprobs, strict=True
        ):
            assert s_pos.keys() == p_pos.keys()
            assert s_pos[token_id].logprob == pytest.approx(p_pos[token_id].logprob, abs=1e-3)
    drafts, draft_tokens, accepted = (
        a - b for a, b in zip(spec_counts(spec_llm), before, strict=True)
    )
    # Drafts were proposed, some accepted and some rejected.
    assert drafts > 0 and 0 < accepted < draft_tokens, (drafts, draft_tokens, accepted)


def test_a_continuation_reuses_the_blocks_of_accepted_tokens(spec_llm: LLM, llm_f32: LLM) -> None:
    """Blocks filled by verified steps enter the prefix cache with their accepted tokens only: a
    second turn whose prompt is the first turn's prompt and answer hits them and continues as
    without speculation."""
    params = SamplingParams(temperature=0, max_tokens=48)
    prompt = spec_llm.get_tokenizer().encode(PROMPTS[0])
    answer = spec_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    follow_up = prompt + list(answer) + spec_llm.get_tokenizer().encode("\n# Once more:\n")
    hits = spec_llm.llm_engine.stats.totals.prefix_cache_hits
    before = spec_counts(spec_llm)
    spec = results(spec_llm, [follow_up], params)
    assert spec == results(llm_f32, [follow_up], params)
    # Every full block of the first turn's prompt and answer was a hit.
    block_size = spec_llm.llm_engine.config.cache.block_size
    num_full_blocks = (len(prompt) + len(answer) - 1) // block_size
    assert spec_llm.llm_engine.stats.totals.prefix_cache_hits - hits >= num_full_blocks * block_size
    assert spec_counts(spec_llm)[2] > before[2]  # the second turn speculated too


def _stop_word(llm: LLM, prompt: str) -> str:
    """A word from the middle of the prompt's greedy answer (a stop string it will meet)."""
    text = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)
    words = [w for w in text[0].outputs[0].text.split() if len(w) >= 3]
    return words[len(words) // 2]


def test_stop_strings_and_max_tokens_cut_inside_a_run(spec_llm: LLM, llm_f32: LLM) -> None:
    params = [
        SamplingParams(temperature=0, max_tokens=30, stop=[_stop_word(llm_f32, PROMPTS[0])]),
        SamplingParams(temperature=0, max_tokens=7, logprobs=0),  # cut mid-run
        SamplingParams(
            temperature=0,
            max_tokens=30,
            stop=[_stop_word(llm_f32, PROMPTS[3])],
            include_stop_str_in_output=True,
        ),
    ]
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[3]]
    spec = results(spec_llm, prompts, params)
    plain = results(llm_f32, prompts, params)
    # Token ids too: those after the stop string's token in the same step are dropped.
    assert spec == plain
    assert [reason for _, _, reason in spec] == ["stop", "length", "stop"]
    assert len(spec[1][0]) == 7


def test_mixed_batch_with_grammars_and_plain_requests(spec_llm: LLM, llm_f32: LLM) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=32)
    regex = SamplingParams(
        temperature=0,
        max_tokens=32,
        structured_outputs=StructuredOutputsParams(regex=r"def [a-z]+\(a, b\):"),
    )
    # A JSON schema, a regex and a choice (spec_utils.GRAMMARS) among plain requests.
    prompts = [*PROMPTS, *GRAMMAR_PROMPTS]
    params = [greedy, regex, greedy, greedy, *grammar_params()]
    before = spec_counts(spec_llm)
    got = results(spec_llm, prompts, params)
    assert got == results(llm_f32, prompts, params)
    assert spec_counts(spec_llm)[2] > before[2]
    check_grammar_outputs(spec_llm, got[len(PROMPTS) :])


def test_drafts_a_json_schema_forbids_are_cut(
    spec_llm: LLM, llm_f32: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prompt's JSON has a key the schema forbids ("job"): the ngram proposer drafts it after
    the name, the grammar cuts the drafts there, and the output is valid and the same as
    without speculation."""
    person = '{"name": "Ann", "job": "cook", "age": 31, "city": "Rome"}'
    prompt = f"A person: {person}. The same person as JSON: {person}. Once more:"
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=GRAMMARS[0])
    checks = record_draft_checks(monkeypatch)
    before = spec_counts(spec_llm)
    got = results(spec_llm, [prompt], params)
    assert got == results(llm_f32, [prompt], params)
    ((_, text, reason),) = got
    assert reason == "stop"
    jsonschema_rs.validate(PERSON, json.loads(text))
    assert any(kept < proposed for proposed, kept in checks), checks
    assert spec_counts(spec_llm)[2] > before[2]  # the drafts the schema allows were accepted


@pytest.fixture(scope="module")
def tiny_folder(gguf_path: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_repeater(tmp_path_factory.mktemp("tiny_spec"), gguf_path)


TINY_BYTES_PER_BLOCK = 2 * 2 * 2 * 16 * 4 * 16  # K and V, 2 layers, 2 KV heads of 16, f32, 16 slots


def test_tiny_model_greedy_and_preemption_while_speculating(tiny_folder: str) -> None:
    common = dict(dtype="float32", max_model_len=256, max_num_seqs=8)
    plain = LLM(tiny_folder, kv_cache_memory=0.05, **common)
    # 32 blocks: 8 requests that each grow to 7 blocks cannot all fit, so some are preempted
    # (their drafts dropped, recomputed) while the others speculate.
    small = LLM(
        tiny_folder,
        kv_cache_memory=32 * TINY_BYTES_PER_BLOCK / 2**30,
        speculative_config=NGRAM | {"prompt_lookup_min": 1},
        **common,
    )
    tokenizer = plain.get_tokenizer()
    prompts = [tokenizer.encode(f"Item {i}: {CODE}")[:40] for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in small.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert small.llm_engine.stats.totals.preemptions > 0
    drafts, draft_tokens, accepted = spec_counts(small)
    assert drafts > 0 and 0 < accepted < draft_tokens, (drafts, draft_tokens, accepted)


def test_seeded_sampled_requests_repeat_with_the_same_config(tiny_folder: str) -> None:
    """What Kiln promises for seeded sampled requests that speculate
    (docs/speculative-decoding.md): the same seed, prompt and config give the same tokens again
    (in another engine too). Not promised, as in vLLM: the tokens of no speculation (the
    rejection sampler draws otherwise; the distribution is the same, see
    test_sampled_distribution.py)."""
    common = dict(dtype="float32", max_model_len=256, max_num_seqs=8, kv_cache_memory=0.05)
    config = NGRAM | {"prompt_lookup_min": 1}
    first_llm = LLM(tiny_folder, speculative_config=config, **common)
    tokenizer = first_llm.get_tokenizer()
    prompts = [tokenizer.encode(f"Item {i}: {CODE}")[:30] for i in range(4)]
    params = [
        SamplingParams(temperature=1.0, top_k=4, seed=11 + i, max_tokens=40, ignore_eos=True)
        for i in range(3)
    ] + [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)]
    first = results(first_llm, prompts, params)
    drafts, draft_tokens, accepted = spec_counts(first_llm)
    assert drafts > 0 and 0 < accepted < draft_tokens, (drafts, draft_tokens, accepted)
    assert results(first_llm, prompts, params) == first
    first_llm.llm_engine.shutdown()
    assert results(LLM(tiny_folder, speculative_config=config, **common), prompts, params) == first


# Greedy speculation bit for bit in bfloat16 (a verified row computed as the decode step at that
# position would compute it) is kiln-x86's promise, not the reference platform's (README,
# "Speculative decoding"): plugins/kiln-x86/tests/test_x86_speculative.py checks it.
