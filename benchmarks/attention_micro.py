"""Micro-benchmark: attention alone for one model step, paged CPU backend vs dense references.

Shapes are SmolLM2-135M's (30 layers, 9 query heads, 3 kv heads, head_dim 64, block_size 16).
Scenarios: a decode step of 16 requests with 512 tokens of context each, and one 512-token
prefill (and a 512-token prefill after 512 cached tokens). For each it prints the best of N ms
per step (all 30 layers; the paged backend's metadata build, once per step, is included and also
shown alone) for:

- paged: ``CPUAttentionBackend`` through the ``Attention`` layer (cache write + attention);
- ref: the dense float32 reference (``ref_attention``) per request over contiguous K/V;
- sdpa: one SDPA call per request over contiguous K/V, no cache: a lower bound for the paged path.

Run: ``PYTHONPATH=src python benchmarks/attention_micro.py [--iters N] [--layers N] [--threads N]``
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kiln.forward_context import ForwardContext, set_forward_context
from kiln.model_executor.layers.attention import Attention, CommonAttentionMetadata
from kiln.model_executor.layers.attention.backends.cpu import CPUAttentionBackend
from kiln.model_executor.layers.attention.backends.torch_ref import ref_attention

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 9, 3, 64, 16
SCALE = HEAD_SIZE**-0.5


def time_ms(fn: Callable[[], object], iters: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    # The minimum: on a shared machine, interference only ever adds time.
    return min(times)


def run_scenario(
    name: str, query_lens: list[int], seq_lens: list[int], num_layers: int, iters: int
) -> None:
    gen = torch.Generator().manual_seed(0)
    num_reqs = len(query_lens)
    blocks_per_req = [-(-s // BLOCK_SIZE) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 8
    perm = torch.randperm(num_blocks, generator=gen).tolist()  # scattered block ids
    tables, used = [], 0
    for n in blocks_per_req:
        tables.append(perm[used : used + n])
        used += n
    computed = [s - q for s, q in zip(seq_lens, query_lens, strict=True)]
    common = CommonAttentionMetadata.from_block_tables(query_lens, computed, tables, BLOCK_SIZE)
    num_tokens = common.num_actual_tokens

    layers = [
        Attention(
            NUM_HEADS, HEAD_SIZE, SCALE, NUM_KV_HEADS, prefix=f"l{i}", backend=CPUAttentionBackend
        )
        for i in range(num_layers)
    ]
    shape = CPUAttentionBackend.get_kv_cache_shape(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    for layer in layers:
        layer.kv_cache = torch.randn(shape, generator=gen)
    builder = CPUAttentionBackend.get_metadata_builder_cls()(BLOCK_SIZE, "cpu")
    q = torch.randn(num_tokens, NUM_HEADS * HEAD_SIZE, generator=gen)
    k = torch.randn(num_tokens, NUM_KV_HEADS * HEAD_SIZE, generator=gen)
    v = torch.randn(num_tokens, NUM_KV_HEADS * HEAD_SIZE, generator=gen)
    # Dense per-request contexts (the same for every layer: attention cost does not care).
    dense_k = [torch.randn(s, NUM_KV_HEADS, HEAD_SIZE, generator=gen) for s in seq_lens]
    dense_v = [torch.randn(s, NUM_KV_HEADS, HEAD_SIZE, generator=gen) for s in seq_lens]
    q3 = q.view(num_tokens, NUM_HEADS, HEAD_SIZE)
    starts = common.query_start_loc.tolist()

    def paged() -> None:
        metadata = builder.build(common)
        with set_forward_context(ForwardContext(metadata, num_tokens=num_tokens)):
            for layer in layers:
                layer(q, k, v)

    def ref() -> None:
        for _ in range(num_layers):
            for i in range(num_reqs):
                ref_attention(q3[starts[i] : starts[i + 1]], dense_k[i], dense_v[i], SCALE)

    def sdpa() -> None:
        for _ in range(num_layers):
            for i in range(num_reqs):
                F.scaled_dot_product_attention(  # 4-D: the fast CPU kernel
                    q3[starts[i] : starts[i + 1]].transpose(0, 1)[None],
                    dense_k[i].transpose(0, 1)[None],
                    dense_v[i].transpose(0, 1)[None],
                    is_causal=query_lens[i] > 1 and computed[i] == 0,
                    scale=SCALE,
                    enable_gqa=True,
                )

    with torch.inference_mode():
        build_ms = time_ms(lambda: builder.build(common), iters)
        results = {"paged": time_ms(paged, iters), "ref": time_ms(ref, iters)}
        results["sdpa"] = time_ms(sdpa, iters)
    summary = ", ".join(f"{key} {ms:7.2f} ms" for key, ms in results.items())
    print(f"{name:<34} {summary}   (paged metadata build {build_ms:.3f} ms)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.layers} layers, "
        f"heads {NUM_HEADS}/{NUM_KV_HEADS}, head_dim {HEAD_SIZE}, block_size {BLOCK_SIZE}; "
        "best-of-N ms per step"
    )
    run_scenario("decode 16 x 512 context", [1] * 16, [512] * 16, args.layers, args.iters)
    run_scenario("prefill 1 x 512", [512], [512], args.layers, args.iters)
    run_scenario("prefill 512 after 512 cached", [512], [1024], args.layers, args.iters)


if __name__ == "__main__":
    main()
