"""The CPU paged-attention backend against the dense reference (``make_sim``: conftest)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.model_executor.layers.attention import CommonAttentionMetadata
from kiln.model_executor.layers.attention.backends.torch_ref import ref_attention

HEADS = [(9, 3), (4, 4), (8, 1)]  # (num_heads, num_kv_heads): SmolLM2's GQA, MHA, MQA


def assert_matches(outputs: dict, refs: dict, atol: float = 2e-5, rtol: float = 2e-5) -> None:
    for req_id in refs:
        torch.testing.assert_close(
            outputs[req_id], refs[req_id], atol=atol, rtol=rtol, msg=lambda m, r=req_id: f"{r}: {m}"
        )


@pytest.mark.parametrize("block_size", [16, 3])
@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
def test_mixed_batches_match_reference(
    make_sim, block_size: int, num_heads: int, num_kv_heads: int
) -> None:
    sim = make_sim(num_heads, num_kv_heads, head_size=32, block_size=block_size, num_blocks=128)
    # Step 1: prefills of several lengths, and a one-token prompt (handled as a decode).
    outputs, refs, _ = sim.step({"a": 20, "b": 7, "c": 1})
    assert_matches(outputs, refs)
    sim.check_cache()
    # Step 2, in mixed order: decodes, the next chunk of b, a prefix hit on a's cached blocks
    # (written by step 1) and the first chunk of a long prompt.
    sim.add_prefix_hit("d", "a", num_blocks=20 // block_size)
    outputs, refs, _ = sim.step({"a": 1, "d": 5, "b": 9, "c": 1, "e": 33})
    assert_matches(outputs, refs)
    sim.check_cache()
    # Step 3: decodes around the rest of e.
    outputs, refs, _ = sim.step({"b": 1, "e": 12, "a": 1, "d": 1, "c": 1})
    assert_matches(outputs, refs)
    sim.check_cache()


def test_many_decodes_of_different_lengths(make_sim) -> None:
    sim = make_sim(block_size=16, num_blocks=256, seed=1)
    lengths = [1, 2, 15, 16, 17, 31, 32, 33, 70, 5, 48, 64]
    sim.step({f"r{i}": n for i, n in enumerate(lengths)})
    for _ in range(3):
        outputs, refs, _ = sim.step({f"r{i}": 1 for i in range(len(lengths))})
        assert_matches(outputs, refs)
    sim.check_cache()


@pytest.mark.parametrize(
    "block_size,chunks", [(16, (10, 20, 15)), (5, (10, 20, 15)), (16, (1, 29, 15))]
)
def test_chunked_prefill_equals_one_shot(make_sim, block_size: int, chunks: tuple) -> None:
    one = make_sim(block_size=block_size, seed=2)
    chunked = make_sim(block_size=block_size, seed=3)  # other block ids
    q, k, v = one.make_inputs(45)
    whole, refs, _ = one.step({"p": 45}, inputs={"p": (q, k, v)})
    assert_matches(whole, refs)
    pieces, start = [], 0
    for size in chunks:
        span = slice(start, start + size)
        outputs, refs, _ = chunked.step({"p": size}, inputs={"p": (q[span], k[span], v[span])})
        assert_matches(outputs, refs)
        pieces.append(outputs["p"])
        start += size
    torch.testing.assert_close(torch.cat(pieces), whole["p"], atol=2e-5, rtol=2e-5)
    chunked.check_cache()


def test_padding_rows_are_zero_and_not_written(make_sim) -> None:
    sim = make_sim(seed=4)
    sim.step({"a": 18})
    outputs, refs, out = sim.step({"a": 1, "b": 6}, num_padding=3)
    assert_matches(outputs, refs)
    assert out.shape[0] == 1 + 6 + 3
    assert bool((out[7:] == 0).all())
    sim.check_cache()


def test_sliding_window_matches_reference(make_sim) -> None:
    sim = make_sim(block_size=4, sliding_window=6, seed=5)
    outputs, refs, _ = sim.step({"a": 13, "b": 3})
    assert_matches(outputs, refs)
    sim.add_prefix_hit("c", "a", num_blocks=2)
    outputs, refs, _ = sim.step({"a": 1, "b": 7, "c": 4})
    assert_matches(outputs, refs)


def test_inside_then_outside_inference_mode(make_sim) -> None:
    sim = make_sim(seed=8)
    with torch.inference_mode():
        sim.kv_cache = sim.layer.kv_cache = sim.kv_cache.clone()  # an inference tensor
        outputs, refs, _ = sim.step({"a": 20, "b": 5})
        outputs, refs, _ = sim.step({"a": 1, "b": 1})  # decode: fills the gather workspace
    assert_matches(outputs, refs)
    sim.kv_cache = sim.layer.kv_cache = sim.kv_cache.clone()  # a normal tensor again
    outputs, refs, _ = sim.step({"a": 1, "b": 1})
    assert_matches(outputs, refs)


def test_bfloat16_cache_and_inputs(make_sim) -> None:
    sim = make_sim(block_size=16, dtype=torch.bfloat16, seed=6)
    sim.step({"a": 40, "b": 3})
    sim.add_prefix_hit("c", "a", num_blocks=2)
    outputs, refs, _ = sim.step({"a": 1, "b": 1, "c": 9})
    assert_matches(outputs, refs, atol=3e-2, rtol=3e-2)
    sim.check_cache()


def test_reference_matches_sdpa_without_cached_prefix() -> None:
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(11, 6, 16, generator=gen)
    k = torch.randn(11, 2, 16, generator=gen)
    v = torch.randn(11, 2, 16, generator=gen)
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(3, 1).transpose(0, 1),
        v.repeat_interleave(3, 1).transpose(0, 1),
        is_causal=True,
        scale=0.3,
    ).transpose(0, 1)
    torch.testing.assert_close(ref_attention(q, k, v, 0.3), expected, atol=1e-5, rtol=1e-5)
    # The last query of a longer context sees every key: a plain softmax over all of them.
    last = ref_attention(q[-1:], k, v, 0.3)
    probs = torch.softmax(torch.einsum("hd,kd->hk", q[-1, :3], k[:, 0]) * 0.3, -1)  # kv head 0
    torch.testing.assert_close(last[0, :3], probs @ v[:, 0], atol=1e-5, rtol=0)


def test_common_metadata_slot_mapping() -> None:
    common = CommonAttentionMetadata.from_block_tables(
        query_lens=[3, 1, 2], num_computed_tokens=[0, 5, 3], block_tables=[[7], [2, 9], [4, 1]],
        block_size=4,
    )  # fmt: skip
    # a: positions 0-2 in block 7; b: position 5 in block 9; c: positions 3, 4 in blocks 4, 1.
    assert common.slot_mapping.tolist() == [28, 29, 30, 37, 19, 4]
    assert common.query_start_loc.tolist() == [0, 3, 4, 6]
    assert common.seq_lens.tolist() == [3, 6, 5]
    assert (common.num_reqs, common.num_actual_tokens) == (3, 6)
    assert (common.max_query_len, common.max_seq_len) == (3, 6)
    with pytest.raises(ValueError, match="cannot hold"):
        CommonAttentionMetadata.from_block_tables([5], [0], [[1]], block_size=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sliding_window", [None, 6])
def test_logits_soft_cap_matches_reference(make_sim, dtype, sliding_window) -> None:
    # Scores here are ~N(0, 1): a cap of 0.8 changes every softmax (checked below).
    sim = make_sim(
        block_size=4, dtype=dtype, sliding_window=sliding_window, logits_soft_cap=0.8, seed=9
    )
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    outputs, refs, _ = sim.step({"a": 13, "b": 3, "c": 1})  # prefills (nothing cached), a decode
    assert_matches(outputs, refs, atol=tol, rtol=tol)
    sim.add_prefix_hit("d", "a", num_blocks=2)
    outputs, refs, _ = sim.step({"a": 1, "b": 7, "c": 1, "d": 4})  # decodes, cached prefixes
    assert_matches(outputs, refs, atol=tol, rtol=tol)
    sim.check_cache()
    q, k, v = sim.make_inputs(1)
    keys, values = torch.cat([sim.keys["a"], k]), torch.cat([sim.values["a"], v])
    uncapped = ref_attention(q, keys, values, sim.scale, sliding_window)
    capped = ref_attention(q, keys, values, sim.scale, sliding_window, 0.8)
    assert (capped.float() - uncapped.float()).abs().max() > 0.05


def test_reference_soft_cap_is_cap_times_tanh_of_the_scaled_scores() -> None:
    # One head, hand-written in float64: softmax over 3 keys of cap * tanh(q.k * scale / cap).
    q = torch.tensor([[[1.0, 2.0]]])  # [1, 1, 2]
    k = torch.tensor([[[0.5, 1.0]], [[-1.0, 3.0]], [[2.0, -2.0]]])  # [3, 1, 2]
    v = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]], [[1.0, 1.0]]])
    scale, cap = 0.7, 1.5
    scores = [
        cap * torch.tanh(torch.tensor(s * scale / cap, dtype=torch.float64))
        for s in (2.5, 5.0, -2.0)
    ]
    probs = torch.softmax(torch.stack(scores), 0)
    expected = (probs[:, None] * v[:, 0].double()).sum(0)
    got = ref_attention(q, k, v, scale, logits_soft_cap=cap)[0, 0]
    torch.testing.assert_close(got.double(), expected, atol=1e-6, rtol=0)
