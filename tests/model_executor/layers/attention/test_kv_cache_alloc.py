"""The CPU KV cache's allocation: zeros, aligned, and not written at start-up."""

from __future__ import annotations

import os

import torch

from kiln.model_executor.layers.attention.layer import CPU_CACHE_ALIGN, zeroed_cpu


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_zeroed_cpu_is_zeros_of_the_shape_and_dtype():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        cache = zeroed_cpu((2, 5, 16, 3, 64), dtype)
        assert cache.shape == (2, 5, 16, 3, 64) and cache.dtype == dtype
        assert cache.is_contiguous() and cache.data_ptr() % CPU_CACHE_ALIGN == 0
        assert not cache.any()
        cache[1, 4, 15, 2, 63] = 1.0  # writable, and the write lands where the view says
        assert cache.flatten()[-1] == 1.0 and cache.sum() == 1.0


def test_a_large_cache_is_not_written_at_allocation():
    size = 512 * 2**20
    before = _resident_bytes()
    cache = zeroed_cpu((2, size // 4 // 2), torch.bfloat16)  # 512 MiB
    grown = _resident_bytes() - before
    assert grown < 64 * 2**20, f"allocating a 512 MiB cache made {grown >> 20} MiB resident"
    assert cache[1, -1] == 0
