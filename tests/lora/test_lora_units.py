"""The ``lora_apply`` op against a per-token loop, and the prefix cache keyed by adapter."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.lora.request import LoRARequest
from kiln.model_executor.layers.lora import LoRAApply, LoRAMapping, random_slots
from kiln.sampling_params import SamplingParams
from kiln.scheduler.kv_cache import KVCacheManager
from kiln.scheduler.request import Request


def _loop_reference(y, x, lora_a, lora_b, indices, slices, rank):
    """Token by token, slice by slice: ``y[t, slice i] + B_i @ (A_i @ x[t])`` with slot ``s``'s
    ``A_i`` the ``rank`` rows of block ``i`` and ``B_i`` the block's entries in slice ``i``'s
    columns (the rest of ``lora_b`` is zero)."""
    out = y.clone()
    for t, slot in enumerate(indices):
        if slot < 0:
            continue
        offset = 0
        for i, size in enumerate(slices):
            rows = slice(i * rank, (i + 1) * rank)
            a = lora_a[slot, rows]  # [R, in]
            b = lora_b[slot, rows, offset : offset + size].T  # [size, R]
            out[t, offset : offset + size] += b @ (a @ x[t])
            offset += size
    return out


@pytest.mark.parametrize(
    "indices",
    [
        [0, -1, 2, 2, 1, -1, 0, 1, -1],  # every slot and the base model
        [2, -1, 1, 2],  # slots 1 and 2 only
        [1, 1, 1],  # one slot for every token: no mask
    ],
)
def test_lora_apply_matches_a_per_token_loop(indices):
    g = torch.Generator().manual_seed(0)
    slices, num_slots, rank, in_features = (12, 4, 4), 3, 5, 16
    lora_a, lora_b = random_slots(slices, num_slots, rank, in_features, g)
    y = torch.randn(len(indices), sum(slices), generator=g)
    x = torch.randn(len(indices), in_features, generator=g)
    expected = _loop_reference(y, x, lora_a, lora_b, indices, slices, rank)
    mapping = LoRAMapping(np.array(indices, dtype=np.int64), x.device)
    got = LoRAApply()(y.clone(), x, lora_a, lora_b, mapping)
    torch.testing.assert_close(got, expected)
    # Base-model tokens (-1) get nothing added.
    base_rows = torch.tensor(indices) < 0
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
