"""The reference CPU platform, built into Kiln.

It is what every other platform is measured against: custom ops run their ``forward_native``,
attention runs the CPU paged backend, and there is no graph capture.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from kiln.platforms.interface import Platform

if TYPE_CHECKING:
    from kiln.config import KilnConfig


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    # float32 first: without native bf16 on most CPUs, fp32 matmuls are the fastest here.
    supported_dtypes = ("float32", "bfloat16", "float16")
    supported_quantization = ()
    supports_graph_capture = False

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
    def get_attn_backend_cls(cls, config: KilnConfig) -> str:
        return "kiln.model_executor.layers.attention.backends.cpu.CPUAttentionBackend"


def cpu_platform_plugin() -> str | None:
    """Built-in detector: the CPU platform is always available."""
    return "kiln.platforms.cpu.CpuPlatform"
