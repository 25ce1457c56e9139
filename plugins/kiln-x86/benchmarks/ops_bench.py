"""Per-call time of each fused op against Kiln's reference (``forward_native``), in one run.

For SmolLM2-135M's shapes (hidden 576, intermediate 1536, 9 query and 3 KV heads of 64) at 1, 16
and 128 tokens, float32 and bfloat16, it times: the reference, a simpler torch-only version, the
C++ kernel called directly (pybind) and through ``torch.ops.kiln_x86`` (the dispatcher). Prints a
table of microseconds per call (best of repeats: the
machine is shared, and the minimum is the least disturbed).

    python plugins/kiln-x86/benchmarks/ops_bench.py [--threads N]
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch
from kiln_x86 import ops
from kiln_x86.kernels import load_kernels

from kiln.model_executor.layers.activation import SiluAndMul
from kiln.model_executor.layers.layernorm import RMSNorm
from kiln.model_executor.layers.rotary_embedding import RotaryEmbedding


def bench(fn, *args, repeats: int = 7, number: int = 200) -> float:
    for _ in range(20):
        fn(*args)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(number):
            fn(*args)
        times.append((time.perf_counter() - start) / number)
    return min(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    k = load_kernels()
    assert k is not None
    rows = []
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            norm = RMSNorm(576, 1e-5, dtype)
            act = SiluAndMul()
            rope = RotaryEmbedding(64, 8192, 100000.0, dtype=dtype)
            for tokens in (1, 16, 128):
                x = torch.randn(tokens, 576).to(dtype)
                res = torch.randn(tokens, 576).to(dtype)
                gu = torch.randn(tokens, 2 * 1536).to(dtype)
                pos = torch.randint(0, 2048, (tokens,))
                q = torch.randn(tokens, 9 * 64).to(dtype)
                kk = torch.randn(tokens, 3 * 64).to(dtype)
                cache = rope.cos_sin_cache
                w = norm.weight
                cases = {
                    "add+rms_norm": (
                        partial(norm.forward_native, x, res),
                        partial(ops.rms_norm_torch, norm, x, res),
                        partial(k.rms_norm, x, res, w, 1e-5),
                        partial(torch.ops.kiln_x86.rms_norm, x, res, w, 1e-5),
                    ),
                    "rotary": (
                        partial(rope.forward_native, pos, q, kk),
                        partial(ops.rotary_torch, rope, pos, q, kk),
                        partial(k.rotary_embedding, pos, q, kk, cache, 64),
                        partial(torch.ops.kiln_x86.rotary_embedding, pos, q, kk, cache, 64),
                    ),
                    "silu_and_mul": (
                        partial(act.forward_native, gu),
                        partial(ops.silu_and_mul_torch, act, gu),
                        partial(k.silu_and_mul, gu),
                        partial(torch.ops.kiln_x86.silu_and_mul, gu),
                    ),
                }
                for op, fns in cases.items():
                    rows.append(
                        (op, str(dtype).removeprefix("torch."), tokens, *(bench(f) for f in fns))
                    )
    print(f"threads={torch.get_num_threads()}  microseconds per call (best of 7)")
    columns = ("native", "torch", "c++", "c++ ops")
    print(f"{'op':14} {'dtype':9} {'tokens':>6} " + " ".join(f"{c:>8}" for c in columns))
    for op, dt, t, *us in rows:
        print(f"{op:14} {dt:9} {t:>6} " + " ".join(f"{u:8.1f}" for u in us))


if __name__ == "__main__":
    main()
