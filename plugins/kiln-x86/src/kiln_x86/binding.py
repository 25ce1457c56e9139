"""Which cores the model's threads and the API server run on, and the pinning itself.

Contract:
- ``plan_binding(options, role, usable)`` is pure: it turns the ``x86`` config section and the
  process role into a ``BindingPlan`` (threads, one core per thread or no pinning, the API
  server's cores), or raises ``ValueError`` naming the field when the cores do not exist here.
- ``pin_model_threads(cpus)`` sizes torch's OpenMP pool to ``len(cpus)`` threads and pins thread
  ``i`` of the pool to ``cpus[i]``, the way vLLM's CPU worker binds its OpenMP threads
  (``VLLM_CPU_OMP_THREADS_BIND``). It runs one parallel region through the OpenMP runtime torch
  itself loaded (``GOMP_parallel``), so the threads pinned are the ones torch's ops run on.
- ``pin_process(cpus)`` pins every thread of this process (the API server).

The API server pins itself before it starts the engine process, which inherits its affinity; so it
first records the cores it was allowed in ``USABLE_CPUS_ENV``, which the engine reads back instead
of its inherited mask.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kiln.plugin_api import worker_cpus
from kiln_x86.options import CPUS_AUTO, CPUS_NONE, X86Options, parse_cpu_list

if TYPE_CHECKING:
    from kiln.plugin_api import KilnConfig

USABLE_CPUS_ENV = "KILN_X86_USABLE_CPUS"
"""Cores the API server was allowed before it pinned itself (read by the engine it starts)."""

SMALL_MACHINE_CORES = 4
"""Below this many usable cores no core is reserved for the API server by default, and the model
runs on one thread: measured on 2 cores with the int8 kernels (docs/x86/threads.md), a
second model thread made decode slower (each of a step's ~250 small parallel regions waits for
it) and left no core for the API server's streaming."""


@dataclass(frozen=True)
class BindingPlan:
    num_threads: int
    """Model (torch intra-op) threads of a step below ``x86.min_prefill_tokens`` tokens."""
    num_prefill_threads: int
    """Model threads of a step of at least ``x86.min_prefill_tokens`` tokens."""
    model_cpus: tuple[int, ...] | None
    """Core of each thread of the pool (``pool_size`` of them), in thread order; None: threads
    are not pinned."""
    api_cpus: tuple[int, ...]
    """Cores the API server is pinned to; empty: it is not pinned."""
    helper_cpus: tuple[int, ...] = ()
    """Core of each matmul helper thread (``x86.helper_threads``; -1: not pinned)."""

    @property
    def pool_size(self) -> int:
        """Threads of torch's pool: the larger of the two counts."""
        return max(self.num_threads, self.num_prefill_threads)


def usable_cpus() -> list[int]:
    """Cores this process may use (as the API server saw them, when it started this process)."""
    inherited = os.environ.get(USABLE_CPUS_ENV)
    if inherited:
        return parse_cpu_list(inherited)
    return sorted(os.sched_getaffinity(0))


def format_cpu_list(cpus: list[int] | tuple[int, ...]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    ranges: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


def plan_binding(
    options: X86Options, role: str | None, usable: list[int], config: KilnConfig | None = None
) -> BindingPlan:
    """Where the model's threads go in a process of ``role`` (api, engine, worker, offline).

    ``engine`` is the engine process beside ``kiln serve``'s API server: only there (and in the
    API server itself) are cores reserved. The API server's plan says where it goes. With
    ``config``, a worker's model cores are its share (``kiln.platforms.worker_cpus``) of the
    cores left for models: engines and tensor-parallel ranks never share a core where there are
    enough of them.

    Raises:
        ValueError: ``x86.cpus`` names cores this process may not use, or ``x86.num_threads``
            asks for more threads than the cores available to pin them to.
    """
    beside_api = role in ("api", "engine")
    reserved = options.reserved_cpus
    if reserved is None:
        reserved = 0 if len(usable) < SMALL_MACHINE_CORES else 1
    if beside_api and reserved >= len(usable):
        raise ValueError(
            f"x86.reserved_cpus={reserved} leaves no core for the model; this process may use "
            f"{len(usable)} core(s) ({format_cpu_list(usable)}); allowed: 0..{len(usable) - 1}"
        )
    if options.cpus in (CPUS_AUTO, CPUS_NONE):
        candidates = usable[reserved:] if beside_api else usable
    else:
        candidates = parse_cpu_list(options.cpus)
        missing = sorted(set(candidates) - set(usable))
        if missing:
            raise ValueError(
                f"x86.cpus={options.cpus!r} names core(s) {format_cpu_list(missing)} this process "
                f"may not use; allowed: cores {format_cpu_list(usable)}"
            )
    if config is not None and role != "api":
        candidates = worker_cpus(config, candidates)
    num_threads = options.num_threads or (
        1 if len(usable) < SMALL_MACHINE_CORES else len(candidates)
    )
    counts = {
        "num_threads": num_threads,
        "num_prefill_threads": options.num_prefill_threads or num_threads,
    }
    pinned = options.cpus != CPUS_NONE
    for field, count in counts.items():
        if pinned and count > len(candidates):
            raise ValueError(
                f"x86.{field}={count} exceeds the {len(candidates)} core(s) available to pin "
                f"them to ({format_cpu_list(candidates)}); allowed: 1..{len(candidates)}, or "
                "x86.cpus='none'"
            )
    model_cpus = tuple(candidates[: max(counts.values())]) if pinned else None
    taken = set(model_cpus or ())
    api_cpus = tuple([c for c in usable if c not in taken][:reserved]) if beside_api else ()
    # Helpers take the cores a decode step's threads leave (prefill threads only wake per step);
    # by default all of them on a small machine, where the model runs on one thread.
    decode_cpus = set(candidates[:num_threads])
    free = [c for c in candidates if c not in decode_cpus] if pinned else []
    helpers = options.helper_threads
    if helpers is None:
        helpers = len(free) if len(usable) < SMALL_MACHINE_CORES else 0
    helper_cpus = tuple(free[:helpers]) + (-1,) * max(0, helpers - len(free))
    return BindingPlan(
        num_threads, counts["num_prefill_threads"], model_cpus, api_cpus, helper_cpus
    )


_PARALLEL_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def _openmp_runtime() -> ctypes.CDLL:
    """The OpenMP runtime torch loaded (its bundled libgomp, else the system's)."""
    import torch

    bundled = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
    return ctypes.CDLL(str(bundled) if bundled.exists() else "libgomp.so.1")


def pin_model_threads(cpus: tuple[int, ...], *, pin_caller: bool = True) -> None:
    """Run torch's ops on ``len(cpus)`` threads, thread ``i`` pinned to core ``cpus[i]``.

    Thread 0 is the calling thread. With ``pin_caller=False`` it is pinned to all of ``cpus``
    instead of ``cpus[0]``: in an offline ``LLM`` the caller is the user's thread, and every thread
    or process it starts later inherits its affinity.

    Raises:
        RuntimeError: a thread could not be pinned (its core id and the OS error).
    """
    import torch

    torch.set_num_threads(len(cpus))
    gomp = _openmp_runtime()
    errors: list[str] = []

    def pin_this_thread(_data: int | None) -> None:
        index = gomp.omp_get_thread_num()
        try:
            # pid 0: the calling thread only.
            os.sched_setaffinity(0, {cpus[index]} if index or pin_caller else set(cpus))
        except (OSError, IndexError) as exc:
            errors.append(f"thread {index} -> core {cpus[min(index, len(cpus) - 1)]}: {exc}")

    callback = _PARALLEL_FN(pin_this_thread)
    # GOMP_parallel(fn, data, num_threads, flags): the entry point `#pragma omp parallel`
    # compiles to; the master thread takes part as thread 0.
    gomp.GOMP_parallel(callback, None, ctypes.c_uint(len(cpus)), ctypes.c_uint(0))
    if errors:
        raise RuntimeError("could not pin the model's threads: " + "; ".join(errors))


def pin_process(cpus: tuple[int, ...]) -> None:
    """Pin every thread of this process (and the threads and processes it starts) to ``cpus``."""
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), set(cpus))
        except (ProcessLookupError, PermissionError):
            pass  # a thread that exited meanwhile


def thread_affinities() -> dict[int, list[int]]:
    """Thread id -> the cores it may run on, for every thread of this process."""
    out = {}
    for task in os.listdir("/proc/self/task"):
        try:
            out[int(task)] = sorted(os.sched_getaffinity(int(task)))
        except (ProcessLookupError, PermissionError):
            pass
    return out


__all__ = [
    "USABLE_CPUS_ENV",
    "BindingPlan",
    "format_cpu_list",
    "pin_model_threads",
    "pin_process",
    "plan_binding",
    "thread_affinities",
    "usable_cpus",
]
