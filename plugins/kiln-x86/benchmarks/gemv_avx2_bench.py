"""The tiled int8 kernel's AVX2 build against the exact float kernel's, on one core.

What an AVX2-only CPU gets, measured on an AVX-512 machine: both kernels built with
``-mno-avx512f`` (the builds such a CPU compiles; the AVX2 gemv under its own op namespace, as
the tests build it), beside this machine's own AVX512-VNNI gemv. Microseconds per call, the best
of ``--repeat`` loops in thread CPU time (``quant_bench.best_us``: one thread, so a shared
machine's other processes cost wall time, not this thread's time), SmolLM2-135M's shapes in its
formats (Q4_1 linears, the Q8_0 LM head) and Q4_0. Columns: the exact float kernel
(``qmatmul``, row layout: what an AVX2 CPU ran before), the AVX2 int8 kernel, the AVX512-VNNI
int8 kernel, and the float / AVX2 speed-up.

    python plugins/kiln-x86/benchmarks/gemv_avx2_bench.py --rows 1,8
"""

from __future__ import annotations

import argparse
import os

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from kiln_x86 import gemv, kernels, quant
from quant_bench import SHAPES, best_us

from kiln.plugin_api import cpu_flags

NO_AVX512 = ["-mno-avx512f"]


def load_builds():
    """(the float kernel's AVX2 build, gemv's AVX2 build, gemv's own build)."""
    float_avx2 = kernels.load_extension(
        "kiln_x86_quant_avx2", quant.SOURCE, [*kernels.CFLAGS, *NO_AVX512]
    )
    flags = [*gemv.build_flags(), *NO_AVX512, "-DKILN_GEMV_LIBRARY=kiln_x86_gemv_avx2"]
    gemv_avx2 = kernels.load_extension("kiln_x86_gemv_avx2", gemv.SOURCE, flags)
    return float_avx2, gemv_avx2, gemv.load_gemv_kernels()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--rows", default="1,8")
    args = parser.parse_args()
    torch.set_num_threads(1)
    float_avx2, gemv_avx2, gemv_own = load_builds()
    has_vnni = "avx512_vnni" in cpu_flags()
    rng = np.random.default_rng(0)
    print(f"threads=1 load={os.getloadavg()[0]:.1f}")
    print("| in -> out | format | rows | float (AVX2) | int8 AVX2 | int8 VNNI | float / AVX2 |")
    print("|---|---|---|---|---|---|---|")
    for k, n in SHAPES:
        w = rng.standard_normal((n, k)).astype(np.float32)
        for qtype in (T.Q8_0,) if n == 49152 else (T.Q4_1, T.Q4_0):
            raw = torch.from_numpy(gguf.quants.quantize(w, qtype))
            p = quant.pack(raw, qtype, n, k)
            tiled = quant.pack(raw, qtype, n, k, tiled=True)
            assert isinstance(tiled, gemv.TiledWeight)
            for rows in [int(r) for r in args.rows.split(",")]:
                x = torch.randn(rows, k).bfloat16()
                calls = [
                    lambda x=x, p=p: float_avx2.qmatmul(
                        x, p.qweight, p.scales, p.mins, p.group, p.bits
                    ),
                    lambda x=x, t=tiled: gemv_avx2.gemv(x, t.data, *t.args()),
                    (lambda x=x, t=tiled: gemv_own.gemv(x, t.data, *t.args()))
                    if has_vnni
                    else None,
                ]
                exact, avx2, vnni = (
                    float("nan") if fn is None else best_us(fn, args.repeat) for fn in calls
                )
                print(
                    f"| {k} -> {n} | {qtype.name} | {rows} | {exact:.0f} | {avx2:.0f} | "
                    f"{vnni:.0f} | {exact / avx2:.2f}x |",
                    flush=True,
                )
    print(f"load={os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
