"""Per-layer attention time: kiln-x86's paged kernel against Kiln's reference CPU backend, one run.

SmolLM2-135M's shapes (9 query heads, 3 KV heads, head size 64, block size 16), blocks scattered
through the cache. Each row is one layer's ``forward`` (the step's cache write plus attention; the
per-step metadata build is not included: it is shared by all 30 layers) for a decode batch of 1
and 16 requests at 128 to 1024 tokens of context, and a 128-token prefill on a 512-token cached
prefix (a prefix-cache hit or a later chunk). Both backends run interleaved, round after round,
and each keeps its best round (interference on a shared machine only ever adds time). With one
thread (the default) the time is the thread's CPU time, which other processes on a busy machine
do not inflate; with more, wall time.

    python plugins/kiln-x86/benchmarks/attention_bench.py [--threads N] [--dtype bfloat16|float32]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from kiln_x86.attention import X86AttentionBackend, load_attention_kernels

from kiln.model_executor.layers.attention.backend import CommonAttentionMetadata
from kiln.model_executor.layers.attention.backends.cpu import CPUAttentionBackend

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 9, 3, 64, 16


def make_case(contexts: list[tuple[int, int]], dtype: torch.dtype):
    """(cache, common metadata, q, k, v) for requests of (num_computed, query_len)."""
    gen = torch.Generator().manual_seed(0)
    blocks = [-(-(c + q) // BLOCK_SIZE) for c, q in contexts]
    num_blocks = sum(blocks) + 8
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in blocks:
        tables.append(perm[used : used + n])
        used += n
    common = CommonAttentionMetadata.from_block_tables(
        [q for _, q in contexts], [c for c, _ in contexts], tables, BLOCK_SIZE
    )
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, generator=gen)
    n = common.num_actual_tokens
    q = torch.randn(n, NUM_HEADS, HEAD_SIZE, generator=gen)
    k = torch.randn(n, NUM_KV_HEADS, HEAD_SIZE, generator=gen)
    v = torch.randn(n, NUM_KV_HEADS, HEAD_SIZE, generator=gen)
    return cache.to(dtype), common, q.to(dtype), k.to(dtype), v.to(dtype)


def layer_call(backend, cache, common, q, k, v):
    impl = backend.get_impl_cls()(NUM_HEADS, HEAD_SIZE, HEAD_SIZE**-0.5, NUM_KV_HEADS)
    metadata = backend.get_metadata_builder_cls()(BLOCK_SIZE, "cpu").build(common)
    return lambda: impl.forward(None, q, k, v, cache, metadata)


def bench_pair(calls: dict, rounds: int, number: int, clock) -> dict[str, float]:
    """Best microseconds per call of each, rounds interleaved."""
    best = dict.fromkeys(calls, float("inf"))
    for fn in calls.values():
        for _ in range(3):
            fn()
    for _ in range(rounds):
        for name, fn in calls.items():
            start = clock()
            for _ in range(number):
                fn()
            best[name] = min(best[name], (clock() - start) / number * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    assert load_attention_kernels() is not None, "the attention kernel did not build"
    cases = [
        (f"decode x{b}, context {c}", [(c - 1, 1)] * b) for b in (1, 16) for c in (128, 512, 1024)
    ]
    cases.append(("prefill 128 on a 512 prefix", [(512, 128)]))
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    print(
        f"# {args.dtype}, {args.threads} thread(s) ({clock.__name__}), "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print("| case | reference (us) | kiln-x86 (us) | speed-up |")
    print("|---|---|---|---|")
    with torch.inference_mode():
        for name, contexts in cases:
            case = make_case(contexts, dtype)
            calls = {
                "reference": layer_call(CPUAttentionBackend, *case),
                "x86": layer_call(X86AttentionBackend, *case),
            }
            number = 20 if "prefill" in name else 50
            best = bench_pair(calls, args.rounds, number, clock)
            print(
                f"| {name} | {best['reference']:.0f} | {best['x86']:.0f} | "
                f"{best['reference'] / best['x86']:.2f}x |"
            )
    print(f"# load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
