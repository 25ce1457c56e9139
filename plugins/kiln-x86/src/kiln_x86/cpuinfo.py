"""What the x86-64 CPU offers: the instruction sets Kiln's x86 kernels care about.

Contract: ``is_x86_64()`` says whether this is an x86-64 machine; ``cpu_features()`` maps each
feature name in ``FEATURES`` to whether ``/proc/cpuinfo`` lists all of its flags (False for every
feature when the file cannot be read). Pure reads, no caching, no side effects.
"""

from __future__ import annotations

import platform

CPUINFO_PATH = "/proc/cpuinfo"

FEATURES: dict[str, tuple[str, ...]] = {
    "avx2": ("avx2", "fma"),
    "avx512": ("avx512f", "avx512bw", "avx512vl"),
    "avx512_bf16": ("avx512_bf16",),
    "amx": ("amx_tile", "amx_bf16"),
}
"""Feature -> the /proc/cpuinfo flags it needs (AMX: tiles and their bf16 multiply)."""


def is_x86_64(machine: str | None = None) -> bool:
    """Whether ``machine`` (default: this one's, per ``platform.machine()``) is x86-64."""
    return (machine or platform.machine()).lower() in ("x86_64", "amd64")


def cpu_flags(path: str = CPUINFO_PATH) -> set[str]:
    """The ``flags`` of the first processor in ``path`` (empty when unreadable)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_features(path: str = CPUINFO_PATH) -> dict[str, bool]:
    """Each feature of ``FEATURES`` -> whether every flag it needs is present."""
    flags = cpu_flags(path)
    return {name: set(needed) <= flags for name, needed in FEATURES.items()}


__all__ = ["CPUINFO_PATH", "FEATURES", "cpu_features", "cpu_flags", "is_x86_64"]
