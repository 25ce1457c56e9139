"""The reference CPU platform, built into Kiln.

It is what every other platform is measured against: custom ops run their ``forward_native``,
attention runs the CPU paged backend, and there is no graph capture.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from kiln.platforms import cpu_flags, process_role, worker_cpus
from kiln.platforms.interface import Platform
from kiln.plugins.config import PLUGIN_CONFIG_REGISTRY

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
    # dtype="auto" (auto_dtype): a half-precision checkpoint's own dtype, else preferred_dtype.
    supported_dtypes = ("float32", "bfloat16", "float16")
    supported_quantization = ()
    supports_graph_capture = False
    config_section: ClassVar[type | None] = CpuOptions

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
    def check_and_update_config(cls, config: KilnConfig) -> KilnConfig:
        if config.model.dtype == "auto":
            config = config.replace(model__dtype=cls.auto_dtype(config))
        if config.model.batch_invariant:
            _check_batch_invariant(config)
        return super().check_and_update_config(config)

    @classmethod
    def preferred_dtype(cls, config: KilnConfig) -> str:
        # bf16 matmuls run ~4x faster than fp32 where the CPU has bf16 instructions; elsewhere
        # they are emulated and slower, so fp32 stays the default there.
        fast_bf16 = "bfloat16" in cls.supported_dtypes and has_native_bf16()
        return "bfloat16" if fast_bf16 else "float32"

    @classmethod
    def register_ops(cls) -> None:
        from kiln.platforms.cpu_batch_invariant import register_batch_invariant_ops
        from kiln.platforms.cpu_ops import register_cpu_ops

        register_cpu_ops()
        register_batch_invariant_ops()

    @classmethod
    def init_worker_process(cls, config: KilnConfig) -> None:
        # A subclass platform may drop the section (config_section = None): then the defaults.
        options = (
            PLUGIN_CONFIG_REGISTRY.get(cls.name, config)
            if cls.config_section is not None
            else CpuOptions()
        )
        torch.set_num_threads(options.num_threads or default_num_threads(config))

    @classmethod
    def get_attn_backend_cls(cls, config: KilnConfig) -> str:
        if config is not None and config.model.batch_invariant:
            return (
                "kiln.model_executor.layers.attention.backends.cpu_batch_invariant."
                "CPUBatchInvariantAttentionBackend"
            )
        return "kiln.model_executor.layers.attention.backends.cpu.CPUAttentionBackend"


def _check_batch_invariant(config: KilnConfig) -> None:
    """Batch invariance is built on oneDNN's bf16 matmul (``kiln.platforms.cpu_batch_invariant``);
    float32 and float16 products here (MKL) give a row another result for another batch size.

    Raises:
        ValueError: another dtype, or no oneDNN bf16 on this CPU.
    """
    from kiln.platforms.cpu_ops import onednn_bf16_available

    if config.model.dtype != "bfloat16":
        raise ValueError(
            f"model.batch_invariant=True is invalid with model.dtype={config.model.dtype!r}; "
            "allowed on the cpu platform: dtype bfloat16 (or auto on a CPU with native bf16)"
        )
    if not onednn_bf16_available():
        raise ValueError(
            "model.batch_invariant=True is invalid here: the cpu platform needs oneDNN bfloat16 "
            "support (a CPU with AVX512-BF16 or AMX), which this machine lacks"
        )


def has_native_bf16() -> bool:
    """Whether the CPU computes bf16 natively (AVX512-BF16 or AMX-BF16), per /proc/cpuinfo."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def default_num_threads(config: KilnConfig) -> int:
    """This worker's share (``worker_cpus``) of the usable cores, less one for the API server
    when this is ``kiln serve``'s engine process."""
    cores = sorted(os.sched_getaffinity(0))
    if process_role() == "engine" and len(cores) > 1:
        cores = cores[1:]
    return len(worker_cpus(config, cores))


def cpu_platform_plugin() -> str | None:
    """Built-in detector: the CPU platform is always available."""
    return "kiln.platforms.cpu.CpuPlatform"
