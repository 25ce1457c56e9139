"""kiln-x86's dense bf16 kernel (``csrc/x86_dense.cpp``) against oneDNN's packed product, one run.

The default model's dense shapes as a bf16 Hugging Face folder has them (fused qkv 960 x 576,
o 576 x 576, fused gate/up 3072 x 576, down 576 x 1536, the 49,152 x 576 LM head), each at 1 to
2,048 rows, random weights and rows. The two products alternate per shape and row count, each
timed as the mean of repeated calls after a warm-up; the weight stays in the caches between
calls where it fits (all but the LM head), so the small shapes' decode rows show cache, not
memory, speed.

Threads: ``--helpers 1`` (the engine's default on a 2-core machine) runs the kernel on the calling
thread and one work-pool helper; oneDNN on ``--threads`` torch threads (1: a decode step's, as
before this kernel; 2: a prefill step's with ``num_prefill_threads`` 2). ``--helpers 0
--threads 2`` runs both on 2 OpenMP threads.

    python plugins/kiln-x86/benchmarks/dense_bench.py [--helpers N] [--threads N]
        [--rows 1,4,16,64,512,2048]
"""

from __future__ import annotations

import argparse
import time

import torch
from kiln_x86 import dense, gemv

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]


def mean_us(fn, reps: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--helpers", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="1,4,16,64,512,2048")
    args = parser.parse_args()
    if not dense.kernel_available():
        raise SystemExit("kiln-x86's dense kernel does not run here (it needs AVX512-BF16)")
    pool = gemv.load_gemv_kernels()
    pool.set_pool_helpers(list(range(1, 1 + args.helpers)))
    torch.set_num_threads(args.threads)
    kernel = torch.ops.kiln_x86_dense_bf16.linear
    onednn = torch.ops.mkldnn._linear_pointwise
    print(f"kernel: calling thread + {args.helpers} helper(s); oneDNN: {args.threads} thread(s)")
    print("| out x in | rows | kernel us | kernel GFLOP/s | oneDNN us | oneDNN / kernel |")
    print("|---|---|---|---|---|---|")
    generator = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        weight = torch.randn(n, k, generator=generator).bfloat16()
        tiled, packed = dense.tiled_weight(weight), dense.packed_weight(weight)
        for rows in (int(r) for r in args.rows.split(",")):
            if n * rows > 49152 * 64:
                continue  # the LM head runs on the sampled rows only
            x = torch.randn(rows, k, generator=generator).bfloat16()
            reps = max(3, int(2e4 / (rows * n * k / 1e6 + 1)))
            ours = mean_us(lambda x=x, w=tiled, n=n: kernel(x, w, None, n), reps)
            theirs = mean_us(lambda x=x, w=packed: onednn(x, w, None, "none", [], ""), reps)
            gflops = 2 * rows * n * k / ours / 1e3
            print(
                f"| {n} x {k} | {rows} | {ours:.1f} | {gflops:.0f} | {theirs:.1f} "
                f"| {theirs / ours:.2f}x |"
            )


if __name__ == "__main__":
    main()
