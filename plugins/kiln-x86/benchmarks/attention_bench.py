"""Per-layer attention time: kiln-x86's paged kernel against Kiln's reference CPU backend, one run.

SmolLM2-135M's shapes (9 query heads, 3 KV heads, head size 64, block size 16), blocks scattered
through the cache. Each row is one layer's ``forward`` (the step's cache write plus attention; the
per-step metadata build is not included: it is shared by all 30 layers) for decode batches of 16
requests at 64 to 512 tokens of context and of 1 request at 512 and 1024, a 128-token prefill
alone and on a 512-token cached prefix (a prefix-cache hit or a later chunk), a mixed step
(15 decodes at 200 tokens and a 128-token prefill, as at concurrency 16 when a request arrives),
and a 2,000-token prompt's prefill.
The backends run interleaved, round after round, and each keeps its best round (interference on
a shared machine only ever adds time). With one thread (the default) the time is the thread's CPU
time, which other processes on a busy machine do not inflate; with more, wall time.

``--f32-probabilities`` also times a build whose bf16 prompt tiles keep their probabilities in
float32 for the value product (``-DKILN_X86_F32_PROBS``; by default they are rounded to bf16 where
the CPU has AVX512-BF16).

``--layers N`` gives each case N layers' caches, called in turn as the model does: with 30 the
K/V no longer fit in the core's L2 cache (16 x 200 tokens are 2.4 MB of bf16 K/V per layer), as
in the engine. ``--baseline REV`` also times the kernel as it was at git revision REV (built from
that revision's ``csrc/`` into the kernel cache), for a before/after in the same run.

    python plugins/kiln-x86/benchmarks/attention_bench.py [--threads N] [--dtype bfloat16|float32]
        [--layers N] [--baseline REV] [--f32-probabilities] [--cases TEXT]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from pathlib import Path
from types import ModuleType

import torch
from kiln_x86.attention import X86AttentionBackend, load_attention_kernels
from kiln_x86.kernels import ATTENTION_CFLAGS, ATTENTION_SOURCE, load_extension

from kiln.model_executor.layers.attention.backend import CommonAttentionMetadata
from kiln.model_executor.layers.attention.backends.cpu import CPUAttentionBackend

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 9, 3, 64, 16


def make_case(contexts: list[tuple[int, int]], dtype: torch.dtype, seed: int = 0):
    """(cache, common metadata, q, k, v) for requests of (num_computed, query_len)."""
    gen = torch.Generator().manual_seed(seed)
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


def layer_calls(backend, layers, kernels: ModuleType | None = None):
    """One call runs every layer's forward in turn; ``kernels``: another build of the x86 one."""
    impl = backend.get_impl_cls()(NUM_HEADS, HEAD_SIZE, HEAD_SIZE**-0.5, NUM_KV_HEADS)
    if kernels is not None:
        impl.kernels = kernels
    metadata = backend.get_metadata_builder_cls()(BLOCK_SIZE, "cpu").build(layers[0][1])

    def call() -> None:
        for cache, _, q, k, v in layers:
            impl.forward(None, q, k, v, cache, metadata)

    return call


def baseline_kernels(rev: str) -> ModuleType:
    """The attention kernel built from git revision ``rev``'s sources (cached like the others)."""
    csrc = ATTENTION_SOURCE.parent
    root = subprocess.run(
        ["git", "rev-parse", "--show-toplevel"], cwd=csrc, capture_output=True, text=True
    ).stdout.strip()
    prefix = csrc.relative_to(root).as_posix()
    names = subprocess.run(
        ["git", "ls-tree", "--name-only", f"{rev}:{prefix}"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    folder = Path(tempfile.mkdtemp(prefix="kiln-x86-baseline-"))
    for name in names:
        if name.endswith((".h", ".cpp")):
            text = subprocess.run(
                ["git", "show", f"{rev}:{prefix}/{name}"],
                cwd=root,
                capture_output=True,
                check=True,
            ).stdout
            (folder / name).write_bytes(text)
    module = load_extension(
        "kiln_x86_attention_baseline", folder / ATTENTION_SOURCE.name, ATTENTION_CFLAGS
    )
    assert module is not None, f"the attention kernel at {rev} did not build"
    return _ArgumentsOfItsTime(module)


class _ArgumentsOfItsTime:
    """An older build's ``paged_attention_update``, called with today's arguments: those it
    does not take yet (appended since) are dropped."""

    def __init__(self, module: ModuleType) -> None:
        self.module = module
        self.num_args: int | None = None

    def paged_attention_update(self, *args: object) -> None:
        if self.num_args is None:
            for n in range(len(args), 0, -1):
                try:
                    self.module.paged_attention_update(*args[:n])
                except TypeError:
                    continue
                self.num_args = n
                return
            raise TypeError("the baseline's paged_attention_update takes none of the arguments")
        self.module.paged_attention_update(*args[: self.num_args])


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
    parser.add_argument("--layers", type=int, default=1, help="layers' caches per case")
    parser.add_argument("--baseline", metavar="REV", help="also time the kernel at git REV")
    parser.add_argument("--cases", help="only the cases whose name contains this text")
    parser.add_argument(
        "--f32-probabilities",
        action="store_true",
        help="also time the kernel built with float32 probabilities in bf16 prompt tiles",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    assert load_attention_kernels() is not None, "the attention kernel did not build"
    baseline = baseline_kernels(args.baseline) if args.baseline else None
    f32_probabilities = None
    if args.f32_probabilities:
        f32_probabilities = load_extension(
            "kiln_x86_attention_f32_probs",
            ATTENTION_SOURCE,
            [*ATTENTION_CFLAGS, "-DKILN_X86_F32_PROBS"],
        )
        assert f32_probabilities is not None, "the float32-probabilities build failed"
    cases = [(f"decode x16, context {c}", [(c - 1, 1)] * 16) for c in (64, 128, 200, 256, 512)]
    cases += [(f"decode x1, context {c}", [(c - 1, 1)]) for c in (512, 1024)]
    cases += [
        ("prefill 128", [(0, 128)]),
        ("prefill 128 on a 512 prefix", [(512, 128)]),
        ("15 decodes at 200 + prefill 128", [(199, 1)] * 15 + [(0, 128)]),
        ("prefill 2000", [(0, 2000)]),
    ]
    if args.cases:
        cases = [case for case in cases if args.cases in case[0]]
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    print(
        f"# {args.dtype}, {args.threads} thread(s) ({clock.__name__}), {args.layers} layer(s), "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    columns = [
        "reference",
        *(["baseline"] if baseline else []),
        *(["f32"] if f32_probabilities else []),
        "x86",
    ]
    heads = {
        "reference": "reference",
        "baseline": f"kiln-x86 at {args.baseline}",
        "f32": "kiln-x86, float32 probabilities",
        "x86": "kiln-x86",
    }
    print("| case | " + " | ".join(f"{heads[c]} (us)" for c in columns) + " | speed-up |")
    print("|---|" + "---|" * len(columns) + "---|")
    with torch.inference_mode():
        for name, contexts in cases:
            layers = [make_case(contexts, dtype, seed) for seed in range(args.layers)]
            calls = {
                "reference": layer_calls(CPUAttentionBackend, layers),
                "x86": layer_calls(X86AttentionBackend, layers),
            }
            if baseline is not None:
                calls["baseline"] = layer_calls(X86AttentionBackend, layers, baseline)
            if f32_probabilities is not None:
                calls["f32"] = layer_calls(X86AttentionBackend, layers, f32_probabilities)
            number = max(
                1, (2 if "2000" in name else 20 if "prefill" in name else 50) // args.layers
            )
            best = bench_pair(calls, args.rounds, number, clock)
            times = " | ".join(f"{best[c] / args.layers:.0f}" for c in columns)
            over = "baseline" if baseline is not None else "reference"
            print(f"| {name} | {times} | {best[over] / best['x86']:.2f}x |")
    print(f"# load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
