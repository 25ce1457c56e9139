"""kiln-x86: Kiln's platform plugin for x86-64 CPUs.

The ``kiln.platform_plugins`` entry point ``x86`` names ``detect``: it activates on x86-64 machines
and returns the dotted path of ``kiln_x86.platform.X86Platform``. It reads ``/proc/cpuinfo`` and
nothing else (a detector has no side effects); the instruction sets it found are shown by
``kiln plugins`` through ``X86Platform.device_info``.
"""

from __future__ import annotations

from kiln_x86.cpuinfo import is_x86_64

PLATFORM_QUALNAME = "kiln_x86.platform.X86Platform"


def detect() -> str | None:
    """The platform's dotted path on an x86-64 CPU, else None."""
    return PLATFORM_QUALNAME if is_x86_64() else None


__all__ = ["PLATFORM_QUALNAME", "detect"]
