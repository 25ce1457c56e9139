"""LoRA offline (``LLM.generate(..., lora_request=...)``) on a tiny random Llama in float32.

The reference is the adapter merged into the base weights by PEFT (``merge_and_unload``), served
by Kiln as a plain model: Kiln with the adapter must give the same greedy tokens, with logprobs
equal to float32 rounding. Then a batch that mixes the three adapters and the base model must
give each request what it gets alone, and the prefix cache must keep adapters apart.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest

from kiln import LLM, LoRARequest, SamplingParams

PROMPTS = [[1, 17, 42, 99, 7, 3, 250, 31], [5, 6, 7, 8, 9, 10, 11, 12, 200, 13, 14]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, logprobs=0)
ENGINE = dict(dtype="float32", kv_cache_memory=0.05, max_model_len=256, max_num_seqs=16)
LOGPROB_ATOL = 1e-3


def _run(llm: LLM, prompts, lora_request=None) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their logprobs, per prompt."""
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=lora_request)
    results = []
    for output in outputs:
        completion = output.outputs[0]
        pairs = zip(completion.logprobs, completion.token_ids, strict=True)
        logprobs = [position[token].logprob for position, token in pairs]
        results.append((list(completion.token_ids), logprobs))
    return results


def _same(got, expected, where: str) -> None:
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got, expected, strict=True):
        assert tokens == ref_tokens, where
        assert logprobs == pytest.approx(ref_logprobs, abs=LOGPROB_ATOL), where


def _lora(adapter, index: int) -> LoRARequest:
    return LoRARequest(adapter.name, index + 1, adapter.path)


@pytest.fixture(scope="module")
def llm(tiny_base: str, gguf_path: str) -> LLM:
    return LLM(
        tiny_base, tokenizer=gguf_path, enable_lora=True, max_loras=3, max_lora_rank=8, **ENGINE
    )


@pytest.fixture(scope="module")
def merged_results(adapters, gguf_path: str) -> list:
    """Per adapter: the merged model's greedy results on ``PROMPTS``."""
    results = []
    for adapter in adapters:
        merged = LLM(adapter.merged, tokenizer=gguf_path, **ENGINE)
        results.append(_run(merged, PROMPTS))
        merged.llm_engine.shutdown()
    return results


def test_adapter_output_equals_the_merged_model(llm, adapters, merged_results):
    base = _run(llm, PROMPTS)
    for index, adapter in enumerate(adapters):
        got = _run(llm, PROMPTS, _lora(adapter, index))
        _same(got, merged_results[index], f"adapter {adapter.name}")
        # Non-trivial: the adapter changes what the base model says.
        assert [t for t, _ in got] != [t for t, _ in base], adapter.name


def test_mixed_batch_gives_each_request_its_own_result(llm, adapters, merged_results):
    loras = [None] + [_lora(adapter, i) for i, adapter in enumerate(adapters)]
    prompts = [prompt for prompt in PROMPTS for _ in loras]
    batch_loras = [lora for _ in PROMPTS for lora in loras]
    mixed = _run(llm, prompts, batch_loras)
    for i, (prompt, lora) in enumerate(zip(prompts, batch_loras, strict=True)):
        alone = _run(llm, [prompt], lora)
        _same([mixed[i]], alone, f"request {i} ({lora and lora.lora_name}) mixed vs alone")
        if lora is not None:
            reference = merged_results[lora.lora_int_id - 1][PROMPTS.index(prompt)]
            _same([mixed[i]], [reference], f"request {i} ({lora.lora_name}) vs merged")


def test_prefix_cache_keeps_adapters_apart(llm, adapters):
    prompt = list(range(1, 40))  # two full blocks of 16
    first = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=_lora(adapters[0], 0))
    again = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=_lora(adapters[0], 0))
    other = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=_lora(adapters[1], 1))
    assert again[0].num_cached_tokens == 32  # the same adapter shares its blocks
    assert other[0].num_cached_tokens == 0  # another adapter never does
    assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids


def test_bad_adapters_are_refused(llm, adapters, tiny_base, gguf_path, tmp_path):
    prompt = PROMPTS[0]
    with pytest.raises(ValueError, match="max_lora_rank"):
        small = LLM(tiny_base, tokenizer=gguf_path, enable_lora=True, max_lora_rank=4, **ENGINE)
        try:
            small.generate([prompt], GREEDY, use_tqdm=False, lora_request=_lora(adapters[0], 0))
        finally:
            small.llm_engine.shutdown()

    plain = pathlib.Path(adapters[0].path)
    lm_head = tmp_path / "lm_head"
    shutil.copytree(plain, lm_head)
    config = json.loads((lm_head / "adapter_config.json").read_text())
    config["target_modules"] = [*config["target_modules"], "lm_head"]
    (lm_head / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="lm_head.*not in the model"):
        llm.generate([prompt], GREEDY, lora_request=LoRARequest("x", 10, str(lm_head)))

    with pytest.raises(ValueError, match="not a PEFT adapter folder"):
        llm.generate([prompt], GREEDY, lora_request=LoRARequest("y", 11, str(tmp_path)))


def test_lora_request_needs_enable_lora(tiny_base, gguf_path, adapters):
    plain = LLM(tiny_base, tokenizer=gguf_path, **ENGINE)
    try:
        with pytest.raises(ValueError, match="enable_lora"):
            plain.generate([PROMPTS[0]], GREEDY, lora_request=_lora(adapters[0], 0))
    finally:
        plain.llm_engine.shutdown()


def test_an_adapter_removed_after_admission_fails_its_requests_only(llm, adapters, tmp_path):
    """The folder goes away between the front end's check and the worker's load (a training job
    rewriting it, a reload after an eviction): its request finishes with finish reason "error"
    and a message without the path; the rest of the batch and later steps are unaffected, and
    the failed step's blocks are not shared once the folder is back."""
    folder = tmp_path / "victim"
    shutil.copytree(adapters[2].path, folder)
    victim = LoRARequest("victim", 20, str(folder))
    prompt = list(range(1, 40))  # two full blocks of 16: the failed step computes them
    engine = llm.llm_engine
    engine.add_request("victim", prompt, GREEDY, lora_request=victim)
    engine.add_request("base", prompt, GREEDY)
    engine.add_request("a0", PROMPTS[0], GREEDY, lora_request=_lora(adapters[0], 0))
    weights = folder / "adapter_model.safetensors"
    saved = weights.read_bytes()
    weights.unlink()
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({out.request_id: out for out in engine.step() if out.finished})
    failed = finished["victim"].outputs[0]
    assert failed.finish_reason == "error" and failed.token_ids == []
    assert "'victim'" in failed.stop_reason and str(tmp_path) not in failed.stop_reason
    for request_id, prompt_ids, lora in (
        ("base", prompt, None),
        ("a0", PROMPTS[0], _lora(adapters[0], 0)),
    ):
        completion = finished[request_id].outputs[0]
        assert completion.finish_reason == "length", request_id
        assert list(completion.token_ids) == _run(llm, [prompt_ids], lora)[0][0], request_id

    weights.write_bytes(saved)  # the folder is back: the same adapter id runs, from scratch
    again = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=victim)[0]
    assert again.num_cached_tokens == 0
    same_weights = _run(llm, [prompt], _lora(adapters[2], 2))
    _same(_run(llm, [prompt], victim), same_weights, "victim once its folder is back")
    assert list(again.outputs[0].token_ids) == same_weights[0][0]
