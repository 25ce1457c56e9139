"""Per-call time of ``fused_moe`` on kiln-x86 against a per-expert loop of the reference's
linears (``FusedMoE.forward_native``: route, then for each routed expert gather its tokens, gate/up
``F.linear``, SiLU-and-mul, down ``F.linear``, weighted ``index_add``), 8 experts, top-2, at 1 and
16 tokens, float32 and bfloat16. Prints microseconds per call (best of repeats: on a shared
machine the minimum is the least disturbed) and the ratio loop / kernel.

    python benchmarks/moe_bench.py [--hidden-size H] [--intermediate-size I] [--threads N]

Needs kiln-x86 (its kernel builds on first use). Timings on a loaded machine mean nothing.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch
from kiln_x86 import moe

from kiln.model_executor.layers.fused_moe import FusedMoE

NUM_EXPERTS, TOP_K = 8, 2


def best_time_us(fn: Callable[[], object], repeats: int, number: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        times.append((time.perf_counter() - start) / number)
    return min(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden-size", type=int, default=2048)
    parser.add_argument("--intermediate-size", type=int, default=768)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--number", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not moe.register_x86_moe():
        raise SystemExit("kiln-x86's MoE kernel could not be built here")
    hidden, inter = args.hidden_size, args.intermediate_size
    print(f"fused_moe: {NUM_EXPERTS} experts, top-{TOP_K}, hidden {hidden}, intermediate {inter}")
    print(f"{'dtype':>9} {'tokens':>6} {'loop us':>10} {'kernel us':>10} {'loop/kernel':>11}")
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            layer = FusedMoE(NUM_EXPERTS, TOP_K, hidden, inter, params_dtype=dtype)
            for param in layer.parameters():
                param.copy_((torch.randn(param.shape, generator=gen) / hidden**0.5).to(dtype))
            for num_tokens in args.tokens:
                x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
                logits = torch.randn(num_tokens, NUM_EXPERTS, generator=gen).to(dtype)
                torch.testing.assert_close(
                    moe.fused_moe(layer, x, logits).float(),
                    layer.forward_native(x, logits).float(),
                    rtol=2e-2,
                    atol=2e-2,
                )
                loop_fn = partial(layer.forward_native, x, logits)
                loop = best_time_us(loop_fn, args.repeats, args.number)
                kernel_fn = partial(moe.fused_moe, layer, x, logits)
                kernel = best_time_us(kernel_fn, args.repeats, args.number)
                name = str(dtype).removeprefix("torch.")
                ratio = loop / kernel
                print(f"{name:>9} {num_tokens:>6} {loop:>10.1f} {kernel:>10.1f} {ratio:>11.2f}")


if __name__ == "__main__":
    main()
