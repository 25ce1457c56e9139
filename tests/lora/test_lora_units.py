"""The ``lora_apply`` op against a per-token loop, and the prefix cache keyed by adapter."""

from __future__ import annotations

import torch

from kiln.lora.request import LoRARequest
from kiln.model_executor.layers.lora import LoRAApply
from kiln.sampling_params import SamplingParams
from kiln.scheduler.kv_cache import KVCacheManager
from kiln.scheduler.request import Request


def _loop_reference(y, x, lora_a, lora_b, indices, slices):
    """Token by token, slice by slice: ``y[t, slice] + B_s @ (A_s @ x[t])``."""
    out = y.clone()
    for t, slot in enumerate(indices.tolist()):
        if slot < 0:
            continue
        offset = 0
        for i, size in enumerate(slices):
            a = lora_a[i, slot]  # [R, in]
            b = lora_b[offset : offset + size, slot]  # [size, R]
            out[t, offset : offset + size] += b @ (a @ x[t])
            offset += size
    return out


def test_lora_apply_matches_a_per_token_loop():
    g = torch.Generator().manual_seed(0)
    slices, num_slots, rank, in_features, num_tokens = (12, 4, 4), 3, 5, 16, 9
    y = torch.randn(num_tokens, sum(slices), generator=g)
    x = torch.randn(num_tokens, in_features, generator=g)
    lora_a = torch.randn(len(slices), num_slots, rank, in_features, generator=g)
    lora_b = torch.randn(sum(slices), num_slots, rank, generator=g)
    indices = torch.tensor([0, -1, 2, 2, 1, -1, 0, 1, -1])
    expected = _loop_reference(y, x, lora_a, lora_b, indices, slices)
    got = LoRAApply()(y.clone(), x, lora_a, lora_b, indices, slices)
    torch.testing.assert_close(got, expected)
    # Base-model tokens (-1) get nothing added.
    base_rows = indices < 0
    assert torch.equal(got[base_rows], y[base_rows])
    assert not torch.allclose(got[~base_rows], y[~base_rows])


def _request(request_id: str, lora: LoRARequest | None) -> Request:
    return Request(request_id, list(range(40)), SamplingParams(max_tokens=1), lora_request=lora)


def test_prefix_cache_shares_blocks_within_an_adapter_only():
    kv = KVCacheManager(num_blocks=32, block_size=16, enable_caching=True, max_model_len=128)
    first = LoRARequest("a", 1, "/a")
    holder = _request("r0", first)
    kv.allocate_slots(holder, holder.num_tokens)
    for request_id, lora, num_hit in (
        ("same", LoRARequest("a", 1, "/a"), 32),
        ("other", LoRARequest("b", 2, "/b"), 0),
        ("base", None, 0),
    ):
        assert kv.get_computed_blocks(_request(request_id, lora)).num_computed_tokens == num_hit
