"""The offline ``LLM`` on the real default model: greedy parity with ``transformers``, preemption
that changes nothing, aborts that free every block, and the front end's errors."""

from __future__ import annotations

import pytest

from kiln import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "List three colors:",
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    # float32: compared token for token with transformers in float32.
    return LLM(kv_cache_memory=0.25, max_num_seqs=8, dtype="float32")


def test_greedy_generate_matches_transformers(llm, hf_model, hf_ref):
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        expected = hf_ref.greedy(hf_model, tokenizer.encode(prompt), GREEDY.max_tokens)
        assert output.outputs[0].token_ids == expected, prompt
        assert output.outputs[0].text == tokenizer.decode(expected)
        assert output.outputs[0].finish_reason == "length"
        assert output.prompt == prompt


def test_preemption_by_a_tiny_kv_cache_gives_the_same_text(llm):
    # 19 usable blocks of 16 tokens; 8 requests that each grow to 4 blocks cannot all fit.
    small = LLM(kv_cache_memory=20 * 16 * 46080 / 2**30, max_num_seqs=8, dtype="float32")
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=40, ignore_eos=True)
    prompts = [f"{p} Number {i}." for i, p in enumerate(PROMPTS * 2)]
    params = [greedy, seeded, seeded, seeded] * 2  # seeded ones replay their draws when resumed
    expected = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].text for o in small.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert small.llm_engine.stats.totals.preemptions > 0
    assert llm.llm_engine.stats.totals.preemptions == 0


def test_abort_frees_every_block(llm):
    engine = llm.llm_engine
    scheduler = engine.engine_core.scheduler
    kv = scheduler.kv_cache_manager
    free_before = kv.get_num_free_blocks()
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"abort-{i}", prompt * 8, SamplingParams(max_tokens=200))
    for _ in range(3):
        engine.step()
    assert kv.get_num_free_blocks() < free_before
    engine.abort_request([f"abort-{i}" for i in range(len(PROMPTS))])
    engine.step()
    assert not engine.has_unfinished_requests()
    assert not scheduler.has_unfinished_requests()
    assert kv.get_num_free_blocks() == free_before


def test_stop_strings_n_and_seeds(llm):
    out = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=30, stop=[" 7"]))
    completion = out[0].outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == " 7"
    assert completion.text == " 5, 6,"
    params = SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=12)
    first = llm.generate("Tell me a joke.", params, use_tqdm=False)[0]
    again = llm.generate(["Hi", "Tell me a joke."], params, use_tqdm=False)[1]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert [c.text for c in first.outputs] == [c.text for c in again.outputs]
    assert len({c.text for c in first.outputs}) > 1


def test_chat_uses_the_model_template(llm):
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=16),
        use_tqdm=False,
    )[0]
    assert out.prompt.startswith("<|im_start|>")
    assert "Paris" in out.outputs[0].text


def test_bad_input_is_a_value_error_and_nothing_is_left_queued(llm):
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate(["fine", "word " * 9000], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match=r"unknown engine argument\(s\) \['max_seqs'\]"):
        LLM(max_seqs=4)


def test_one_prompt_of_any_mapping_or_sequence_type(llm):
    """A single prompt given as a mapping that is not a dict, or as a tuple of token ids, is one
    prompt (a non-dict mapping used to be taken as a list of its keys)."""
    from types import MappingProxyType

    short = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    (reference,) = llm.generate({"prompt_token_ids": [5, 6, 7]}, short, use_tqdm=False)
    for prompt in (MappingProxyType({"prompt_token_ids": [5, 6, 7]}), (5, 6, 7)):
        (output,) = llm.generate(prompt, short, use_tqdm=False)
        assert output.outputs[0].token_ids == reference.outputs[0].token_ids
