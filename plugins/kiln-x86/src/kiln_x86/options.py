"""The x86 platform's config section, ``--plugin-config '{"x86": {...}}'``.

Contract: ``X86Options`` is a frozen dataclass whose every field has a default; ``__post_init__``
rejects values that are wrong on any machine (a ``ValueError`` naming the field and what is
allowed). Whether the named cores exist here is checked when a worker starts
(``kiln_x86.binding.plan_binding``). ``parse_cpu_list`` reads Linux's list syntax ("0-3,8").
"""

from __future__ import annotations

from dataclasses import dataclass

CPUS_AUTO = "auto"
CPUS_NONE = "none"
GRAPH_MODES = ("trace", "inductor")


def parse_cpu_list(text: str) -> list[int]:
    """``"0-3,8"`` -> ``[0, 1, 2, 3, 8]`` (sorted, no duplicates).

    Raises:
        ValueError: not a comma-separated list of core ids and ``a-b`` ranges with ``a <= b``.
    """
    cpus: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"{text!r} is not a core list like '0-3,8'")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"{text!r} has a descending range {part.strip()!r}")
        cpus.update(range(first, last + 1))
    return sorted(cpus)


@dataclass(frozen=True)
class X86Options:
    """``--plugin-config '{"x86": {...}}'``: where the model's threads run."""

    num_threads: int | None = None
    """Threads the model runs on (torch intra-op threads). Default: one per core of ``cpus``; one
    on machines with fewer than 4 usable cores (measured on 2: faster decode, and a core left for
    the API server)."""
    num_prefill_threads: int | None = None
    """Threads for a step that computes at least ``min_prefill_tokens`` tokens (a wave of new
    prompts), whose matmuls are long enough to pay for waking more threads; e.g. 2 on an idle
    2-core machine. Default: ``num_threads`` (measured on a 2-core machine shared with other
    work, a second thread made such steps several times slower: docs/x86/threads.md).
    Results do not depend on it (every kernel computes a row the same way on any thread
    count)."""
    min_prefill_tokens: int = 256
    """Tokens a step computes (all its requests together) from which it runs on
    ``num_prefill_threads`` threads; shorter steps (decodes) run on ``num_threads``."""
    cpus: str = CPUS_AUTO
    """Cores the model's threads are pinned to, one thread per core, in Linux list syntax
    (``"0-3,8"``). ``"auto"``: the cores this process may use, less ``reserved_cpus`` when an API
    server runs beside the engine; ``"none"``: no pinning (the OS schedules the threads)."""
    reserved_cpus: int | None = None
    """Cores kept for ``kiln serve``'s API server, which is pinned to them (the model's threads are
    not). Default: 0 on machines with fewer than 4 usable cores (measured on 2 cores: the model
    gains more from both cores than the API server loses), else 1."""
    int8_activations: bool = True
    """Kept-quantized GGUF weights: round the activations to int8 per block of 32 and multiply
    with integer dot products (``kiln_x86.gemv``: AVX512-VNNI, else AVX2 with the same results,
    for decode; AMX tiles for prefill where the CPU has them), for every row count, with the same
    result per row whatever the row count, so a prefix-cached prompt and the whole prompt agree.
    Where the CPU has neither AVX2 nor AVX512-VNNI it changes nothing (the exact kernels run).
    ``false``: the exact float kernels (weights dequantized in registers; prefill dequantizes and
    runs the dense bf16 GEMM)."""

    helper_threads: int | None = None
    """Threads beside the model's that share the int8 matmul kernels' calls (``kiln_x86.gemv``),
    each pinned to a core of ``cpus`` that a decode step's threads do not use (unpinned where
    none is left). They claim a call's chunks from one counter, so the model's thread never
    waits for a helper that the OS has not scheduled (unlike an OpenMP barrier). Default: every
    such core on machines with fewer than 4 usable cores (measured on 2, idle: 1 helper took
    serve c=1 from 63.3 to 129.6 output tok/s and c=16 from 270.8 to 347.1); else 0 (the model
    already runs on every core)."""
    graph: str = "trace"
    """How decode steps run from a graph per bucket (``kiln_x86.graph``): ``"trace"``
    (``torch.jit.trace``, about a second per bucket at start-up; buckets 1, 2, 4, 8, 16 by
    default) or ``"inductor"`` (``torch.compile``, minutes per bucket on a first start; no
    buckets unless ``--graph-capture-sizes`` names them)."""

    def __post_init__(self) -> None:
        if self.graph not in GRAPH_MODES:
            raise ValueError(
                f"x86.graph={self.graph!r} is invalid; allowed: "
                + ", ".join(repr(m) for m in GRAPH_MODES)
            )
        if not isinstance(self.int8_activations, bool):
            raise ValueError(
                f"x86.int8_activations={self.int8_activations!r} is invalid; allowed: true, false"
            )
        for field in ("num_threads", "num_prefill_threads"):
            value = getattr(self, field)
            if value is not None and value < 1:
                raise ValueError(f"x86.{field}={value} is invalid; allowed: >= 1")
        if self.min_prefill_tokens < 1:
            raise ValueError(
                f"x86.min_prefill_tokens={self.min_prefill_tokens} is invalid; allowed: >= 1"
            )
        if self.helper_threads is not None and self.helper_threads < 0:
            raise ValueError(f"x86.helper_threads={self.helper_threads} is invalid; allowed: >= 0")
        if self.reserved_cpus is not None and self.reserved_cpus < 0:
            raise ValueError(f"x86.reserved_cpus={self.reserved_cpus} is invalid; allowed: >= 0")
        if self.cpus in (CPUS_AUTO, CPUS_NONE):
            return
        try:
            cpus = parse_cpu_list(self.cpus)
        except ValueError as exc:
            raise ValueError(
                f"x86.cpus={self.cpus!r} is invalid ({exc}); allowed: 'auto', 'none' or a core "
                "list like '0-3,8'"
            ) from None
        for field in ("num_threads", "num_prefill_threads"):
            value = getattr(self, field)
            if value is not None and value > len(cpus):
                raise ValueError(
                    f"x86.{field}={value} exceeds the {len(cpus)} core(s) of "
                    f"x86.cpus={self.cpus!r}; allowed: 1..{len(cpus)} (one thread per core)"
                )


__all__ = ["CPUS_AUTO", "CPUS_NONE", "GRAPH_MODES", "X86Options", "parse_cpu_list"]
