"""Weight-only GGUF matmul against dense bf16 ``F.linear``, on SmolLM2-135M's shapes.

Microseconds per call, the best of ``--repeat`` loops in thread CPU time (one thread), every column
from the same run. Columns: dense bf16 and float32 ``F.linear`` (the baselines), kiln-x86's kernel
(``quant.matmul`` as served by default: without int8 activations, C++ up to ``MAX_KERNEL_ROWS``
rows, then dequantize + dense GEMM), the C++ float kernel alone, the row layout's int8 kernel
alone, the tiled int8 kernel (``kiln_x86.gemv``) alone and dequantize + bf16 GEMM alone at every
row count, and torch's built-in int4 kernel
(``_weight_int4pack_mm_for_cpu``, group 32) with float32 activations and with bfloat16 ones (whose
scales and zeros it wants in bfloat16, which GGUF's float16 scales do not survive).

    python plugins/kiln-x86/benchmarks/quant_bench.py --threads 1
    python plugins/kiln-x86/benchmarks/quant_bench.py --model --threads 1,2 --rows 1,4,16

``--model``: one pass over the default model's real weights per row count and thread count
(see ``model_pass``).
"""

from __future__ import annotations

import argparse
import os
import time

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from kiln_x86 import gemv, quant

SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152)]


def best_us(fn, repeat: int, budget_s: float = 0.02) -> float:
    """Best of ``repeat`` loops, in this thread's CPU time (the machine is shared: wall time
    counts other processes' slices; with ``--threads 1`` torch runs on this thread)."""
    fn()
    start = time.thread_time()
    fn()
    once = max(time.thread_time() - start, 1e-6)
    loops = max(1, int(budget_s / once))
    best = float("inf")
    for _ in range(repeat):
        start = time.thread_time()
        for _ in range(loops):
            fn()
        best = min(best, (time.thread_time() - start) / loops)
    return best * 1e6


def int4pack(w: np.ndarray):
    """Q4_1 of w as torch's int4 layout: w = (q - 8) * scale + zero, group 32."""
    n, k = w.shape
    raw = gguf.quants.quantize(w, T.Q4_1)
    p = quant.pack(torch.from_numpy(raw), T.Q4_1, n, k)
    lo, hi = p.qweight & 0x0F, p.qweight >> 4
    q = torch.stack([lo.reshape(n, -1, 16), hi.reshape(n, -1, 16)], 2).reshape(n, k).int()
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    zero = p.mins + 8 * p.scales  # (q - 8) * s + zero == q * s + min
    sz = torch.stack([p.scales.t(), zero.t()], -1).contiguous()
    return packed, sz


COLUMNS = [
    "bf16 dense",
    "fp32 dense",
    "kiln-x86 (bf16 x)",
    "C++ kernel",
    "int8 kernel",
    "int8 tiled",
    "dequant + GEMM",
    "torch int4 (fp32 x)",
    "torch int4 (bf16 x)",
]


def measure_row(w: np.ndarray, qtype: T, rows: int, repeat: int) -> list[float]:
    """One table row: microseconds per call of each column (NaN where it does not apply)."""
    n, k = w.shape
    raw = torch.from_numpy(gguf.quants.quantize(w, qtype))
    p = quant.pack(raw, qtype, n, k)
    tiled = quant.pack(raw, qtype, n, k, tiled=True) if gemv.available() else None
    ext = quant.load_quant_kernels()
    wb, wf = torch.from_numpy(w).bfloat16(), torch.from_numpy(w)
    xb = torch.randn(rows, k).bfloat16()
    xf = xb.float()
    int4_mm = torch.ops.aten._weight_int4pack_mm_for_cpu
    calls = [
        lambda: torch.nn.functional.linear(xb, wb),
        lambda: torch.nn.functional.linear(xf, wf),
        lambda: quant.matmul(xb, p),
        lambda: ext.qmatmul(xb, p.qweight, p.scales, p.mins, p.group, p.bits),
        lambda: ext.qmatmul_int8(xb, p.qweight, p.scales, p.mins, p.group, p.bits),
        (lambda: gemv.matmul(xb, tiled)) if tiled is not None else None,
        lambda: torch.nn.functional.linear(xb, quant.dequantize(p, torch.bfloat16)),
    ]
    if not hasattr(ext, "qmatmul_int8"):  # built with AVX512-VNNI only
        calls[4] = None
    cols = [float("nan") if fn is None else best_us(fn, repeat) for fn in calls]
    if qtype == T.Q4_1 and rows <= 16:  # slow beyond
        i4, sz = int4pack(w)
        szb = sz.bfloat16()
        cols.append(best_us(lambda: int4_mm(xf, i4, 32, sz), repeat))
        cols.append(best_us(lambda: int4_mm(xb, i4, 32, szb), repeat))
    else:
        cols += [float("nan")] * 2
    return cols


def model_pass(path: str, rows_list: list[int], repeat: int, threads_list: list[int]) -> None:
    """Every linear of the real GGUF once (a decode step's matmuls, the LM head included), in
    model order, so that the weights stream from memory as they do when decoding (a model's
    worth of weights is larger than the caches): dense bf16, the exact float kernel (row layout),
    the row layout's int8 kernel, the tiled weights' VNNI kernel alone at every row count, the tiled
    weights as served (``gemv.matmul``: VNNI below ``AMX_MIN_ROWS`` rows, AMX tiles from there
    where they run) and dequantize + GEMM (the exact path's prefill), interleaved in each round.
    Thread CPU time at 1 thread, wall time at more."""
    reader = gguf.GGUFReader(path)
    packed, tiled, dense = [], [], []
    for t in reader.tensors:
        qtype = T(t.tensor_type)
        if qtype not in quant.SUPPORTED_TYPES:
            continue
        k, n = (int(d) for d in t.shape)
        raw = torch.from_numpy(np.asarray(t.data).copy())
        p = quant.pack(raw, qtype, n, k)
        packed.append(p)
        if gemv.available():
            tiled.append(quant.pack(raw, qtype, n, k, tiled=True))
        dense.append(quant.dequantize(p, torch.bfloat16))
    mib = [sum(p.nbytes for p in ps) / 2**20 for ps in (packed, tiled)]
    d_bytes = sum(w.numel() * 2 for w in dense)
    print(
        f"{len(packed)} weights: row layout {mib[0]:.0f} MiB, tiled {mib[1]:.0f} MiB, "
        f"bf16 {d_bytes / 2**20:.0f} MiB"
    )
    columns = [
        "bf16 dense",
        "float kernel (exact)",
        "int8 kernel, row layout",
        "int8 VNNI kernel only",
        "int8 tiled (served)",
        "dequantize + GEMM",
    ]
    print("| threads | rows | " + " | ".join(f"{c}, ms" for c in columns) + " |")
    print("|---|---|" + "---|" * len(columns))
    threshold = quant.MAX_KERNEL_ROWS
    ext = gemv.load_gemv_kernels() if tiled else None
    for threads in threads_list:
        torch.set_num_threads(threads)
        clock = time.thread_time if threads == 1 else time.perf_counter
        for rows in rows_list:
            xs = {k: torch.randn(rows, k).bfloat16() for k in {p.in_features for p in packed}}

            def run_dense(xs=xs) -> None:
                for w in dense:
                    torch.nn.functional.linear(xs[w.shape[1]], w)

            def run_quant(max_kernel_rows: int, int8_max_rows: int, xs=xs, weights=packed):
                quant.MAX_KERNEL_ROWS = max_kernel_rows
                try:
                    for p in weights:
                        quant.matmul(xs[p.in_features], p, int8_max_rows)
                finally:
                    quant.MAX_KERNEL_ROWS = threshold

            def run_vnni(xs=xs) -> None:  # the decode kernel at every row count
                for p in tiled:
                    ext.gemv(xs[p.in_features], p.data, *p.args())

            # The register kernels' columns only where they finish in reasonable time.
            small = rows <= 128
            runs = [
                run_dense,
                (lambda rows=rows: run_quant(rows, 0)) if small else None,
                # Q6_K (none in the default model): dense
                (lambda rows=rows: run_quant(0, rows)) if small else None,
                run_vnni if tiled and rows <= 512 else None,
                (lambda: run_quant(0, 0, weights=tiled)) if tiled else None,
                lambda: run_quant(0, 0),
            ]
            best = [float("inf")] * len(runs)
            for _ in range(repeat):  # interleaved, so that each column sees the same load
                for i, fn in enumerate(runs):
                    if fn is None:
                        continue
                    start = clock()
                    fn()
                    best[i] = min(best[i], clock() - start)
            cells = " | ".join("-" if t == float("inf") else f"{t * 1e3:.1f}" for t in best)
            print(f"| {threads} | {rows} | {cells} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", default="1", help="with --model: a list, e.g. 1,2")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--rows", default="1,8,16,128")
    parser.add_argument(
        "--model", action="store_true", help="one pass over the default model's real weights"
    )
    args = parser.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    torch.set_num_threads(threads[0])
    if args.model:
        from kiln.model_executor.loader.default_model import default_model_path

        print(f"load={os.getloadavg()[0]:.1f}")
        rows = [int(r) for r in args.rows.split(",")]
        model_pass(default_model_path(), rows, args.repeat, threads)
        print(f"load={os.getloadavg()[0]:.1f}")
        return
    rng = np.random.default_rng(0)
    print(f"threads={threads[0]} load={os.getloadavg()[0]:.1f}")
    print("| in -> out | format | rows | " + " | ".join(COLUMNS) + " |")
    print("|---|---|---|" + "---|" * len(COLUMNS))
    for k, n in SHAPES:
        w = rng.standard_normal((n, k)).astype(np.float32)
        qtype = T.Q8_0 if n == 49152 else T.Q4_1  # the default model's formats
        for rows in [int(r) for r in args.rows.split(",")]:
            cols = measure_row(w, qtype, rows, args.repeat)
            cells = " | ".join("-" if c != c else f"{c:.0f}" for c in cols)
            print(f"| {k} -> {n} | {qtype.name} | {rows} | {cells} |", flush=True)
    print(f"load={os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
