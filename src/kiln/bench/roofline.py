"""The machine's bounds for serving figures (a roofline): what its memory bandwidth and matrix
rate allow a model on a workload, so that a benchmark says how far from the limit each engine is,
not only how it compares with the others.

Contract:

- ``measure_machine(num_threads)`` measures, with torch on this process and its threads, the read
  bandwidth (one pass over an array far larger than the caches) and the dense matrix rates in
  float32, bfloat16 and int8 (``torch.matmul`` / ``torch._int_mm``: oneDNN's or MKL's kernels on
  these machines), each the best of a few runs, since interference only ever adds time. Run it on
  an idle machine: a busy one gives bounds that are too low.
- ``ModelShape.from_gguf(path)`` reads a model's shape and the bytes a decode step reads (every
  weight once: the embedding too when it is the LM head, as in tied models) from a GGUF file;
  ``ModelShape.flops_per_token(context)`` counts the linears' and attention's multiply-adds.
- ``workload_bound(...)`` is the best a workload of ``num_prompts`` requests (``input_len`` in,
  ``output_len`` out, ``concurrency`` at a time) could do on the machine: its output tok/s when
  every step is bound by reading the weights or by the matrix rate, whichever is slower, and its
  time to first token for one request alone.

It knows nothing about any engine: the figures are the machine's and the model's.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

PEAK_DTYPES = ("float32", "bfloat16", "int8")


@dataclass(frozen=True)
class Machine:
    bandwidth_gbs: float
    """Read bandwidth from memory, GB/s."""
    peak_gflops: dict[str, float]
    """Dense matrix product rate per dtype of ``PEAK_DTYPES``, GFLOP/s (int8: GOP/s)."""

    @property
    def matrix_peak(self) -> tuple[str, float]:
        """The fastest dtype and its rate: the machine's compute bound."""
        name = max(self.peak_gflops, key=self.peak_gflops.__getitem__)
        return name, self.peak_gflops[name]

    def describe(self) -> str:
        rates = ", ".join(f"{k} {v:.0f}" for k, v in self.peak_gflops.items())
        return f"read bandwidth {self.bandwidth_gbs:.1f} GB/s; matrix GFLOP/s: {rates}"


def _best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: first-touch pages, kernel selection
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_machine(
    num_threads: int | None = None, array_mib: int = 1024, size: int = 2048, repeats: int = 3
) -> Machine:
    """The machine's read bandwidth and matrix rates (see the module docstring).

    Args:
        num_threads: torch threads for the measurement (default: every core).
        array_mib: the array read for the bandwidth; far larger than the last-level cache.
        size: the matrices' side (``size`` cubed multiply-adds per product).
    """
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(num_threads or os.cpu_count() or 1)
    try:
        array = torch.ones(array_mib * 2**20 // 4, dtype=torch.float32)
        seconds = _best_seconds(array.sum, repeats)
        bandwidth = array.numel() * 4 / seconds / 1e9
        del array
        gen = torch.Generator().manual_seed(0)
        peaks: dict[str, float] = {}
        for dtype in PEAK_DTYPES:
            if dtype == "int8":
                a = torch.randint(-127, 128, (size, size), dtype=torch.int8, generator=gen)
                b = torch.randint(-127, 128, (size, size), dtype=torch.int8, generator=gen)

                def product(a=a, b=b) -> object:
                    return torch._int_mm(a, b)
            else:
                a = torch.randn(size, size, generator=gen).to(getattr(torch, dtype))
                b = torch.randn(size, size, generator=gen).to(getattr(torch, dtype))

                def product(a=a, b=b) -> object:
                    return a @ b

            peaks[dtype] = 2 * size**3 / _best_seconds(product, repeats) / 1e9
        return Machine(bandwidth, peaks)
    finally:
        torch.set_num_threads(saved)


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    num_heads: int
    head_dim: int
    linear_params: int
    """Weights each token is multiplied by: every layer's linears and the LM head."""
    lm_head_params: int
    """Of those, the LM head's, which a prompt's tokens skip but its last (no logits needed)."""
    weight_bytes: int
    """Bytes a decode step reads: every weight once (not the embedding table unless it is the LM
    head: a lookup reads one row)."""

    def flops_per_token(self, context: int, logits: bool = True) -> float:
        """One token's FLOPs (2 per multiply-add) over ``context`` earlier tokens: the linears
        (the LM head only with ``logits``), and attention's scores and weighted values."""
        attention = 2 * 2 * self.num_layers * self.num_heads * self.head_dim * context
        linears = self.linear_params - (0 if logits else self.lm_head_params)
        return 2 * linears + attention

    @classmethod
    def from_gguf(cls, path: str) -> ModelShape:
        import gguf

        reader = gguf.GGUFReader(path)
        arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()

        def field(name: str) -> int:
            return int(reader.fields[f"{arch}.{name}"].parts[-1][0])

        tensors = {t.name: t for t in reader.tensors}
        tied = "output.weight" not in tensors
        lm_head = tensors["token_embd.weight" if tied else "output.weight"]
        linear_params, weight_bytes = 0, 0
        for name, t in tensors.items():
            is_embedding = name == "token_embd.weight"
            if len(t.shape) == 2 and (not is_embedding or tied):
                linear_params += int(t.n_elements)
            if not is_embedding or tied:
                weight_bytes += int(t.n_bytes)
        num_heads = field("attention.head_count")
        return cls(
            num_layers=field("block_count"),
            num_heads=num_heads,
            head_dim=field("embedding_length") // num_heads,
            linear_params=linear_params,
            lm_head_params=int(lm_head.n_elements),
            weight_bytes=weight_bytes,
        )

    def with_weight_bytes(self, bytes_per_param: float) -> ModelShape:
        """The same model with dense weights of ``bytes_per_param`` (2: a bf16 checkpoint)."""
        return ModelShape(
            self.num_layers,
            self.num_heads,
            self.head_dim,
            self.linear_params,
            self.lm_head_params,
            int(self.linear_params * bytes_per_param),
        )


@dataclass(frozen=True)
class Bound:
    output_tok_s: float
    """Output tokens/s if every step ran at the machine's limit."""
    limit: str
    """What bounds the decode steps: ``memory`` or the matrix dtype."""
    ttft_ms: float
    """Time to first token of one request alone: its prefill at the matrix rate (or one read of
    the weights, if longer)."""


def workload_bound(
    machine: Machine,
    model: ModelShape,
    concurrency: int,
    input_len: int,
    output_len: int,
    num_prompts: int,
) -> Bound:
    """The machine's bound for a workload (see the module docstring): the whole run takes at
    least its FLOPs at the matrix rate, and at least one read of the weights per decode step
    (``num_prompts * output_len / concurrency`` of them)."""
    _, peak = machine.matrix_peak
    flops_per_second = peak * 1e9
    bytes_per_second = machine.bandwidth_gbs * 1e9
    # A prompt's tokens need no logits but the last's (which is also its first output token).
    prompt_flops = sum(model.flops_per_token(i, logits=False) for i in range(input_len))
    prompt_flops += 2 * model.lm_head_params
    decode_flops = sum(model.flops_per_token(input_len + i) for i in range(output_len))
    compute_s = num_prompts * (prompt_flops + decode_flops) / flops_per_second
    num_steps = num_prompts * output_len / max(1, min(concurrency, num_prompts))
    memory_s = num_steps * model.weight_bytes / bytes_per_second
    limit = "memory" if memory_s >= compute_s else machine.matrix_peak[0]
    ttft_s = max(prompt_flops / flops_per_second, model.weight_bytes / bytes_per_second)
    return Bound(num_prompts * output_len / max(compute_s, memory_s), limit, ttft_s * 1e3)
