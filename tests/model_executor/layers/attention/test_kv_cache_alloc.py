"""The CPU KV cache's allocation: zeros, aligned, and not written at start-up."""

from __future__ import annotations

import subprocess
import sys

import torch

from kiln.model_executor.layers.attention.layer import CPU_CACHE_ALIGN, zeroed_cpu


def test_zeroed_cpu_is_zeros_of_the_shape_and_dtype():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        cache = zeroed_cpu((2, 5, 16, 3, 64), dtype)
        assert cache.shape == (2, 5, 16, 3, 64) and cache.dtype == dtype
        assert cache.is_contiguous() and cache.data_ptr() % CPU_CACHE_ALIGN == 0
        assert not cache.any()
        cache[1, 4, 15, 2, 63] = 1.0  # writable, and the write lands where the view says
        assert cache.flatten()[-1] == 1.0 and cache.sum() == 1.0


MEASURE_ALLOCATION = """
import os, torch
from kiln.model_executor.layers.attention.layer import zeroed_cpu

def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

before = resident()
cache = zeroed_cpu((2, 512 * 2**20 // 4 // 2), torch.bfloat16)  # 256 MiB of bfloat16
grown = resident() - before
assert cache[1, -1] == 0
print(grown)
"""


def test_a_large_cache_is_not_written_at_allocation():
    # In a process of its own: another test's threads in this one (an engine shutting down, a
    # server) may touch memory between the two readings.
    result = subprocess.run(
        [sys.executable, "-c", MEASURE_ALLOCATION],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    grown = int(result.stdout.split()[-1])
    assert grown < 64 * 2**20, f"allocating a 256 MiB cache made {grown >> 20} MiB resident"
