"""The model runner's graph seam: buckets, padding, and eager steps outside the buckets.

On the reference cpu platform ``graph_capture_sizes`` turns the padding on while the wrapper stays
``EagerGraphWrapper``, so these tests check the runner's side of the contract in
``kiln.worker.graph`` (which steps are padded, to what, what padding may touch) on the real model in
float32; the compiled wrapper that replays the buckets is tested in the kiln-x86 plugin.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.config import KilnConfig, SchedulerConfig
from kiln.engine.arg_utils import EngineArgs
from kiln.forward_context import get_forward_context
from kiln.scheduler.kv_cache import NULL_BLOCK_ID
from kiln.worker.graph import EagerGraphWrapper, graph_capture_sizes, padded_size

_FRESH_PROCESS = "KILN_TEST_GRAPH_BUCKETS_FRESH_PROCESS"
BUCKETS = (1, 2, 4, 8)
MAX_NUM_SEQS = 9  # one above the largest bucket: that batch runs eagerly
PROMPTS = [
    "The capital of France is",
    "def add(a, b):",
    "Once upon a time",
    "The three primary colors are",
    "import numpy as",
    "Water boils at",
    "My favourite fruit is",
    "The quick brown fox",
    "In 1969, the first",
]


def _config(max_num_seqs: int, sizes: tuple[int, ...] | None) -> KilnConfig:
    return KilnConfig(scheduler=SchedulerConfig(max_num_seqs=max_num_seqs)).replace(
        device__graph_capture_sizes=sizes
    )


def test_default_buckets_follow_the_platform_and_max_num_seqs() -> None:
    assert graph_capture_sizes(_config(64, None), supports_graph_capture=False) == []
    assert graph_capture_sizes(_config(64, None), True) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graph_capture_sizes(_config(8, None), True) == [1, 2, 4, 8]
    assert graph_capture_sizes(_config(20, None), True) == [1, 2, 4, 8, 16, 20]
    # Set explicitly: used on any platform, sizes above max_num_seqs dropped, sorted, deduplicated.
    assert graph_capture_sizes(_config(8, (16, 4, 1, 4)), False) == [1, 4]
    assert graph_capture_sizes(_config(8, ()), True) == []
    # With drafts a step of 2 requests has up to 2 * (1 + 3) tokens: the buckets reach 8.
    speculative = _config(2, None).replace(
        speculative__method="ngram", speculative__num_speculative_tokens=3
    )
    assert graph_capture_sizes(speculative, True) == [1, 2, 4, 8]
    # And the multiples of 1 + k up to the largest: 4 requests verifying 4 drafts each fit 20.
    speculative = _config(4, (1, 2, 4, 8, 16)).replace(
        speculative__method="ngram", speculative__num_speculative_tokens=4
    )
    assert graph_capture_sizes(speculative, True) == [1, 2, 4, 5, 8, 10, 15, 16]
    assert graph_capture_sizes(speculative.replace(device__graph_capture_sizes=()), True) == []


def test_padded_size_at_bucket_edges() -> None:
    expected = {1: 1, 2: 2, 3: 4, 4: 4, 5: 8, 7: 8, 8: 8, 9: None}
    assert {n: padded_size(BUCKETS, n) for n in expected} == expected


def test_bad_capture_sizes_are_refused_with_the_field() -> None:
    with pytest.raises(ValueError, match="graph_capture_sizes"):
        EngineArgs(graph_capture_sizes="1,0").create_config()
    with pytest.raises(ValueError, match="device.graph_capture_sizes"):
        _config(8, (2, -1))
    assert EngineArgs(graph_capture_sizes="1, 2,8").create_config().device.graph_capture_sizes == (
        1,
        2,
        8,
    )


class RecordingWrapper(EagerGraphWrapper):
    """The reference wrapper, recording ``(padded tokens, real tokens)`` of every call."""

    def __init__(self, inner: EagerGraphWrapper) -> None:
        super().__init__(inner.runnable, inner.config)
        self.calls: list[tuple[int, int]] = []

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> Any:
        metadata = get_forward_context().attn_metadata
        self.calls.append((input_ids.shape[0], metadata.num_actual_tokens))
        return super().__call__(input_ids, positions)


@pytest.fixture(scope="module")
def bucketed_llm(gguf_path: str) -> LLM:
    try:
        return LLM(
            gguf_path,
            dtype="float32",
            kv_cache_memory=0.25,
            max_model_len=1024,
            max_num_seqs=MAX_NUM_SEQS,
            graph_capture_sizes=list(BUCKETS),
            platform="cpu",
        )
    except Exception as exc:
        if "already selected" not in str(exc) or os.environ.get(_FRESH_PROCESS):
            raise
    # A process selects its platform once, and an earlier test in this one selected another
    # (kiln-x86, when installed): run this file's engine tests in a fresh process instead.
    done = subprocess.run(
        [sys.executable, "-m", "pytest", __file__, "-q", "-m", "slow", "-p", "no:cacheprovider"],
        # Kiln's session fixtures (llm_f32) come first, so name the platform for them too.
        env={**os.environ, _FRESH_PROCESS: "1", "KILN_PLATFORM": "cpu"},
        capture_output=True,
        text=True,
        timeout=1500,
    )
    if done.returncode != 0:
        output = f"{done.stdout[-6000:]}\n{done.stderr[-2000:]}"
        pytest.fail(f"in a fresh process (cpu platform):\n{output}")
    pytest.skip(f"passed in a fresh process: {done.stdout.strip().splitlines()[-1]}")


def _runner(llm: LLM) -> Any:
    return llm.llm_engine.engine_core.executor.worker.model_runner


@pytest.mark.slow
@pytest.mark.parametrize("batch", range(1, MAX_NUM_SEQS + 1))
def test_padded_decodes_match_unpadded(bucketed_llm, llm_f32, batch) -> None:
    """Every batch size around every bucket edge (b - 1, b, b + 1): the same greedy tokens and
    logprobs as an engine without buckets; every step of at most the largest bucket's tokens (the
    decodes, a prompt that short) goes through the wrapper padded to a bucket, larger ones do
    not."""
    runner = _runner(bucketed_llm)
    assert runner.graph_sizes == list(BUCKETS)
    original = runner.runnable
    spy = runner.runnable = RecordingWrapper(original)
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=2, ignore_eos=True)
    try:
        ours = bucketed_llm.generate(PROMPTS[:batch], params, use_tqdm=False)
    finally:
        runner.runnable = original
    reference = llm_f32.generate(PROMPTS[:batch], params, use_tqdm=False)
    for got, want in zip(ours, reference, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        for step_got, step_want in zip(
            got.outputs[0].logprobs, want.outputs[0].logprobs, strict=True
        ):
            for token_id, logprob in step_want.items():
                assert step_got[token_id].logprob == pytest.approx(logprob.logprob, abs=1e-4)
    # One prefill step of every prompt, then three decode steps of the whole batch.
    steps = [sum(len(out.prompt_token_ids) for out in ours)] + [batch] * 3
    assert spy.calls == [(padded_size(BUCKETS, n), n) for n in steps if n <= max(BUCKETS)]


@pytest.mark.slow
def test_padding_rows_write_only_the_real_slots(bucketed_llm) -> None:
    """A decode step of 3 requests padded to 4 changes exactly the 3 requests' KV slots."""
    engine = bucketed_llm.llm_engine
    runner = _runner(bucketed_llm)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokenizer = bucketed_llm.get_tokenizer()
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(f"pad-{i}", tokenizer.encode(prompt), params)
    engine.step()  # the prefill
    engine.step()  # a first decode, so the next step's slots are in use
    batch = runner.input_batch
    rows = [batch.req_id_to_index[f"pad-{i}"] for i in range(3)]
    # The next step writes position num_computed of each request.
    positions = [int(batch.num_computed_tokens[row]) for row in rows]
    expected = {
        int(batch.block_table[row, pos // runner.block_size]) * runner.block_size
        + pos % runner.block_size
        for row, pos in zip(rows, positions, strict=True)
    }
    assert NULL_BLOCK_ID * runner.block_size not in expected
    before = {name: cache.clone() for name, cache in runner.kv_caches.items()}
    engine.step()
    for name, cache in runner.kv_caches.items():
        # [2, num_blocks, block_size, Hkv, D] -> per slot: did K or V change?
        changed = (cache != before[name]).flatten(3).any(-1).any(0).flatten()
        assert set(torch.nonzero(changed).flatten().tolist()) == expected, name
    engine.abort_request([f"pad-{i}" for i in range(3)])
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.slow
def test_speculative_verifications_go_through_the_wrapper(bucketed_llm, llm_f32, gguf_path) -> None:
    """With ngram drafts, a step verifying a request's 1 + k tokens fits a bucket and goes
    through the wrapper padded; greedy tokens stay those of no speculation."""
    del bucketed_llm  # in the main process it ran this file in a fresh one (cpu platform)
    llm = LLM(
        gguf_path,
        dtype="float32",
        kv_cache_memory=0.05,
        max_model_len=1024,
        max_num_seqs=2,
        graph_capture_sizes=list(BUCKETS),
        platform="cpu",
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2},
    )
    runner = _runner(llm)
    spy = runner.runnable = RecordingWrapper(runner.runnable)
    prompt = "Repeat after me: one two three four five six. one two three four five six. one two"
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == llm_f32.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    verifications = [(size, n) for size, n in spy.calls if 1 < n <= 4]
    assert verifications, spy.calls  # one request with drafts: 2..4 tokens, not a prompt
    assert all(size == padded_size(BUCKETS, n) for size, n in spy.calls)
