"""What the x86-64 CPU offers: the instruction sets Kiln's x86 kernels care about.

Contract: ``is_x86_64()`` says whether this is an x86-64 machine; ``cpu_features()`` maps each
feature name in ``FEATURES`` to whether ``/proc/cpuinfo`` lists all of its flags (False for every
feature when the file cannot be read). The flags are Kiln's ``kiln.platforms.cpu_flags()``: read
once per process, no other side effects.
"""

from __future__ import annotations

import platform

from kiln.plugin_api import cpu_flags

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


def cpu_features(path: str | None = None) -> dict[str, bool]:
    """Each feature of ``FEATURES`` -> whether every flag it needs is listed, in this machine's
    /proc/cpuinfo or in the cpuinfo file ``path``."""
    flags = cpu_flags() if path is None else cpu_flags(path)
    return {name: set(needed) <= flags for name, needed in FEATURES.items()}


__all__ = ["FEATURES", "cpu_features", "is_x86_64"]
