"""``current_platform``: the platform this process's plugin lifecycle selected.

The lifecycle (``kiln.plugins.init_process``, layer above) selects the platform once, when the
process starts, and records it here with ``set_current_platform``, which also points the custom
ops' dispatch at its device type. Nothing below the lifecycle selects: reading
``current_platform`` before the selection is an error, never a selection, so that importing
``kiln`` or running a layer picks nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kiln.model_executor.custom_op import OP_REGISTRY
from kiln.platforms.interface import PLATFORM_API_VERSION, Platform

if TYPE_CHECKING:
    from kiln.config import KilnConfig

    current_platform: type[Platform]

_selected: type[Platform] | None = None
_role: str | None = None


def set_current_platform(platform_cls: type[Platform] | None, role: str | None = None) -> None:
    """Record the process's platform and role (``api``, ``engine``, ``worker``, ``offline``, or
    None where a tool selected without a lifecycle). Called by the plugin lifecycle's select
    phase; None forgets the selection (tests).

    Side effects: custom ops dispatch on ``platform_cls.device_type`` from the next call on.
    """
    global _selected, _role
    _selected, _role = platform_cls, role
    OP_REGISTRY.select_device(platform_cls.device_type if platform_cls is not None else None)


def process_role() -> str | None:
    """The role the lifecycle gave this process, or None before it (or outside one)."""
    return _role


def worker_cpus(config: KilnConfig, cpus: Sequence[int]) -> list[int]:
    """The cores of ``cpus`` that this worker (``config.parallel.rank`` of engine
    ``config.parallel.data_parallel_rank``) runs on, when all the workers of the server on this
    machine (``data_parallel_size`` engines of ``world_size`` ranks) share ``cpus``.

    The shares are contiguous and disjoint, engine-major (engine 0's ranks first), and cover
    ``cpus``; the first ``len(cpus) % workers`` are one core larger. With fewer cores than
    workers, worker ``i`` gets core ``cpus[i % len(cpus)]`` (shared, but each has one). A platform
    that sizes or pins thread pools calls this in ``init_worker_process``.
    """
    parallel = config.parallel
    num_workers = parallel.data_parallel_size * parallel.world_size
    index = parallel.data_parallel_rank * parallel.world_size + parallel.rank
    cpus = list(cpus)
    if num_workers == 1 or not cpus:
        return cpus
    if len(cpus) < num_workers:
        return [cpus[index % len(cpus)]]
    size, extra = divmod(len(cpus), num_workers)
    start = index * size + min(index, extra)
    return cpus[start : start + size + (index < extra)]


CPUINFO_PATH = "/proc/cpuinfo"


@functools.cache
def cpu_flags(cpuinfo: str = CPUINFO_PATH) -> frozenset[str]:
    """The instruction-set flags Linux lists for this machine's CPU: the ``flags`` line of the
    first processor in ``cpuinfo`` (``avx512_bf16``, ``amx_bf16``, ...). Empty where the file
    cannot be read or has no such line (another OS; ARM names its line ``Features``).

    Read once per path and process: a machine's flags do not change while it runs (a test that
    writes a cpuinfo file of its own writes each version to another path).
    """
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def __getattr__(name: str) -> Any:
    if name == "current_platform":
        if _selected is None:
            raise RuntimeError(
                "no platform is selected in this process yet: kiln.plugins.init_process(role, "
                "config) selects it when the process starts (an LLM, kiln serve and the engine "
                "process run it)"
            )
        return _selected
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CPUINFO_PATH",
    "PLATFORM_API_VERSION",
    "Platform",
    "cpu_flags",
    "current_platform",
    "process_role",
    "set_current_platform",
    "worker_cpus",
]
