"""kiln-x86: Kiln's platform plugin for x86-64 CPUs.

The ``kiln.platform_plugins`` entry point ``x86`` names ``detect``: it activates on x86-64 machines
and returns the dotted path of ``kiln_x86.platform.X86Platform``, unless ``KILN_X86=0`` (then the
built-in cpu platform is chosen without ``--platform``, and another out-of-tree platform can be
auto-selected beside this package, as Kiln's plugin tests do). It has no side effects; the
instruction sets found are shown by ``kiln plugins`` through ``X86Platform.device_info``.
"""

from __future__ import annotations

import os

from kiln_x86.cpuinfo import is_x86_64

PLATFORM_QUALNAME = "kiln_x86.platform.X86Platform"
DISABLE_ENV = "KILN_X86"
"""``KILN_X86=0`` keeps the detector inactive."""


def detect() -> str | None:
    """The platform's dotted path on an x86-64 CPU (unless ``KILN_X86=0``), else None."""
    if os.environ.get(DISABLE_ENV, "").strip() == "0":
        return None
    return PLATFORM_QUALNAME if is_x86_64() else None


__all__ = ["DISABLE_ENV", "PLATFORM_QUALNAME", "detect"]
