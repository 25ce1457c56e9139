"""The reference CPU platform, built into Kiln.

It is what every other platform is measured against: custom ops run their ``forward_native``,
attention runs the CPU paged backend, and there is no graph capture.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kiln.platforms.interface import Platform

if TYPE_CHECKING:
    from kiln.config import KilnConfig


@dataclass(frozen=True)
class CpuOptions:
    """``--plugin-config '{"cpu": {...}}'``."""

    num_threads: int | None = None
    """Threads the model runs on (torch intra-op threads). Default: every core this process may
    use, less one when an API server runs beside the engine (``kiln serve``): a thread whose core
    is taken by another process stalls every parallel op of the step."""

    def __post_init__(self) -> None:
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"cpu.num_threads={self.num_threads} is invalid; allowed: >= 1")


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    # float32 first: without native bf16 on most CPUs, fp32 matmuls are the fastest here.
    supported_dtypes = ("float32", "bfloat16", "float16")
    supported_quantization = ()
    supports_graph_capture = False
    config_section = CpuOptions

    @classmethod
    def device_count(cls) -> int:
        return 1

    @classmethod
    def mem_get_info(cls, device: torch.device) -> tuple[int, int]:
        """Free and total system memory, from ``/proc/meminfo`` (MemAvailable, MemTotal)."""
        info: dict[str, int] = {}
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    key, _, rest = line.partition(":")
                    info[key] = int(rest.split()[0]) * 1024
            return info["MemAvailable"], info["MemTotal"]
        except (OSError, KeyError, ValueError):
            pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
            total = pages * page_size
            return total // 2, total

    @classmethod
    def init_worker_process(cls, config: KilnConfig) -> None:
        from kiln.plugins.config import PLUGIN_CONFIG_REGISTRY

        # A subclass platform may drop the section (config_section = None): then the defaults.
        options = (
            PLUGIN_CONFIG_REGISTRY.get(cls.name, config) if cls.config_section else CpuOptions()
        )
        torch.set_num_threads(options.num_threads or default_num_threads())

    @classmethod
    def get_attn_backend_cls(cls, config: KilnConfig) -> str:
        return "kiln.model_executor.layers.attention.backends.cpu.CPUAttentionBackend"


def default_num_threads() -> int:
    """Usable cores, less one for the API server when this is ``kiln serve``'s engine process."""
    from kiln.plugins.manager import get_plugin_manager

    cores = len(os.sched_getaffinity(0))
    return max(1, cores - 1) if get_plugin_manager().role == "engine" else cores


def cpu_platform_plugin() -> str | None:
    """Built-in detector: the CPU platform is always available."""
    return "kiln.platforms.cpu.CpuPlatform"
