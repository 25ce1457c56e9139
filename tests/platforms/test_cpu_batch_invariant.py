"""Batch invariance on the cpu platform: the op-level facts the mode is built on, its config checks,
and the acceptance bar through ``LLM``: 32 different prompts submitted together give each (of eight
checked) the same greedy tokens as that prompt alone, in float32 and in bfloat16 with
``batch_invariant=True`` (where seeded sampling must also match)."""

from __future__ import annotations

import argparse

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.engine.arg_utils import EngineArgs
from kiln.model_executor.layers.attention.backend import CommonAttentionMetadata
from kiln.model_executor.layers.attention.backends.cpu_batch_invariant import (
    CPUBatchInvariantAttentionBackend,
)
from kiln.platforms import cpu_batch_invariant, cpu_ops
from kiln.platforms.cpu import CpuPlatform, has_native_bf16

needs_bf16 = pytest.mark.skipif(
    not (has_native_bf16() and cpu_ops.onednn_bf16_available()),
    reason="batch-invariant mode needs oneDNN bf16 (AVX512-BF16 or AMX)",
)

TOPICS = [
    "the ocean", "a red bicycle", "quantum computers", "my grandmother", "the moon landing",
    "bread baking", "a lost cat", "winter in Oslo", "jazz music", "the Roman empire",
    "a rainy Tuesday", "electric cars", "honeybees", "chess openings", "volcanoes",
    "a haunted house", "coffee", "the stock market", "dinosaurs", "friendship", "a broken clock",
    "mountain climbing", "origami", "the first computer", "a desert island", "snowflakes",
    "paper airplanes", "a tiny robot", "lighthouses", "the color blue", "tea ceremonies",
    "marathon running",
]  # fmt: skip
# Two shapes of prompt, so the batch mixes lengths (7 to 13 tokens).
PROMPTS = [
    f"Write one sentence about {t}:" if i % 2 else f"Here is a short story about {t}. Once"
    for i, t in enumerate(TOPICS)
]
# 24 tokens: with 16, the decode attention's padding (fixed by the mode) changed no token here.
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
ENGINE_KWARGS = dict(kv_cache_memory=0.25, max_num_seqs=32, enable_prefix_caching=False)
# SmolLM2-135M's products (input, output): qkv, o, gate_up, down, LM head.
MODEL_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]


def _llm(**kwargs) -> LLM:
    from kiln import platforms
    from kiln.config import KilnConfig
    from kiln.plugins import init_process

    # One engine thread: the machines these tests run on are shared, and a second thread whose
    # core is busy stalls every op (the op-level tests below cover two threads). The cpu platform
    # and the platforms built on it (kiln-x86) take num_threads in their own config section;
    # the lifecycle selects the process's platform (the LLM's runs it again, a no-op but configure).
    init_process("offline", KilnConfig())
    threads = {platforms.current_platform.name: {"num_threads": 1}}
    return LLM(**ENGINE_KWARGS, plugin_config=threads, **kwargs)


# The prompts also run alone: both shapes, the batch's first and last rows and rows between. A
# row-count-dependent reduction changes every row of the batch, so eight of them see it; running
# all 32 alone made these the suite's three slowest tests (800 one-row steps each).
SOLO = (0, 5, 10, 15, 20, 25, 30, 31)


def _batch_vs_solo(llm: LLM, params: SamplingParams | list[SamplingParams]) -> list[int]:
    """Indices (among ``SOLO``) of the prompts whose tokens differ between the batch of all 32
    and a run alone."""
    per_prompt = params if isinstance(params, list) else [params] * len(PROMPTS)
    outputs = llm.generate(PROMPTS, per_prompt, use_tqdm=False)
    together = [o.outputs[0].token_ids for o in outputs]
    assert [len(t) for t in together] == [p.max_tokens for p in per_prompt]
    alone = {
        i: llm.generate(PROMPTS[i], per_prompt[i], use_tqdm=False)[0].outputs[0].token_ids
        for i in SOLO
    }
    return [i for i in SOLO if together[i] != alone[i]]


# -- the acceptance bar, through LLM -------------------------------------------------------------
# Nine generate calls each; on a shared 2-core machine 33 of them took over 600 s.
LLM_TIMEOUT_S = 1800


@pytest.mark.slow
@pytest.mark.timeout(LLM_TIMEOUT_S)
def test_float32_batch_of_32_matches_each_prompt_alone(gguf_path):
    llm = _llm(dtype="float32")
    assert _batch_vs_solo(llm, GREEDY) == []


@pytest.fixture(scope="module")
def batch_invariant_llm(gguf_path) -> LLM:
    return _llm(dtype="bfloat16", batch_invariant=True)


@pytest.mark.slow
@pytest.mark.timeout(LLM_TIMEOUT_S)
@needs_bf16
def test_batch_invariant_bf16_batch_of_32_matches_each_prompt_alone(batch_invariant_llm):
    config = batch_invariant_llm.llm_engine.config
    assert config.device.attention_backend.endswith("CPUBatchInvariantAttentionBackend")
    assert _batch_vs_solo(batch_invariant_llm, GREEDY) == []


@pytest.mark.slow
@pytest.mark.timeout(LLM_TIMEOUT_S)
@needs_bf16
def test_batch_invariant_bf16_seeded_sampling_matches_each_prompt_alone(batch_invariant_llm):
    seeded = [
        SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=16, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    assert _batch_vs_solo(batch_invariant_llm, seeded) == []


# -- the facts the mode rests on -----------------------------------------------------------------
@needs_bf16
@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize(("in_features", "out_features"), MODEL_SHAPES)
def test_tiled_onednn_rows_equal_their_one_row_products(in_features, out_features, num_threads):
    generator = torch.Generator().manual_seed(in_features + out_features)
    layer = torch.nn.Linear(in_features, out_features, bias=False)
    weight = (0.05 * torch.randn(out_features, in_features, generator=generator)).bfloat16()
    x = torch.randn(300, in_features, generator=generator).bfloat16()
    saved = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        # Every prefix length up to the tile, a prompt-sized batch, and a batch past the tile.
        alone = torch.cat([cpu_ops._linear(row[None], layer, weight, None) for row in x])
        for num_rows in (*range(1, 40), 64, 127, 128, 129, 200, 300):
            rows = cpu_batch_invariant._tiled(x[:num_rows], layer, weight, None)
            assert torch.equal(rows, alone[:num_rows]), num_rows
    finally:
        torch.set_num_threads(saved)


@needs_bf16
@pytest.mark.parametrize("seed", [9, 25, 28, 34])
def test_decode_attention_of_a_request_does_not_depend_on_the_others(seed):
    # A request's output changes with the others' lengths only where a bf16 result sits on a
    # rounding tie, which random data rarely hits: with these seeds the plain backend's padding
    # changes one request's output (found by search on this project's CPUs, torch 2.13).
    backend = CPUBatchInvariantAttentionBackend
    num_heads, num_kv_heads, head_size, block_size = 9, 3, 64, 16
    impl = backend.get_impl_cls()(num_heads, head_size, head_size**-0.5, num_kv_heads)
    builder = backend.get_metadata_builder_cls()(block_size)
    generator = torch.Generator().manual_seed(seed)
    # 24 short requests (3 to 15 tokens) and one of 64 tokens, the last; 4 blocks each.
    context_lens = [3 + i % 13 for i in range(24)] + [64]
    num_reqs = len(context_lens)
    shape = backend.get_kv_cache_shape(4 * num_reqs, block_size, num_kv_heads, head_size)
    cache = torch.randn(shape, generator=generator).bfloat16()
    # Peaked scores (x3), as a trained model's are.
    query = (3 * torch.randn(num_reqs, num_heads, head_size, generator=generator)).bfloat16()
    key = torch.randn(num_reqs, num_kv_heads, head_size, generator=generator).bfloat16()
    value = torch.randn(num_reqs, num_kv_heads, head_size, generator=generator).bfloat16()

    def attend(rows: list[int]) -> torch.Tensor:
        # Request i keeps blocks [4i, 4i + 4) and query row i whatever batch it is in.
        common = CommonAttentionMetadata.from_block_tables(
            [1] * len(rows),
            [context_lens[i] - 1 for i in rows],
            [list(range(4 * i, 4 * i + 4)) for i in rows],
            block_size,
        )
        md = builder.build(common)
        return impl.forward(None, query[rows], key[rows], value[rows], cache.clone(), md)

    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        together = attend(list(range(num_reqs)))  # the plain backend pads all to 64 tokens
        differ = [i for i in range(num_reqs) if not torch.equal(together[i], attend([i])[0])]
    finally:
        torch.set_num_threads(saved)
    assert differ == []


# -- config and flags --------------------------------------------------------------------------
def test_batch_invariant_flag_reaches_the_config():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    on = EngineArgs.from_cli_args(parser.parse_args(["--batch-invariant"])).create_config()
    off = EngineArgs.from_cli_args(parser.parse_args([])).create_config()
    assert on.model.batch_invariant is True and off.model.batch_invariant is False


def test_batch_invariant_must_be_a_bool():
    with pytest.raises(ValueError, match=r"model\.batch_invariant='yes' is invalid"):
        EngineArgs(batch_invariant="yes").create_config()  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_cpu_platform_refuses_batch_invariance_outside_bfloat16(dtype):
    config = EngineArgs(dtype=dtype, batch_invariant=True).create_config()
    with pytest.raises(ValueError, match=rf"model\.batch_invariant=True .*model\.dtype='{dtype}'"):
        CpuPlatform.check_and_update_config(config)


@needs_bf16
def test_cpu_platform_picks_the_batch_invariant_backend_only_when_asked():
    on = CpuPlatform.check_and_update_config(EngineArgs(batch_invariant=True).create_config())
    off = CpuPlatform.check_and_update_config(EngineArgs().create_config())
    assert on.model.dtype == "bfloat16"
    assert on.device.attention_backend.endswith(
        "cpu_batch_invariant.CPUBatchInvariantAttentionBackend"
    )
    assert off.device.attention_backend.endswith("cpu.CPUAttentionBackend")
