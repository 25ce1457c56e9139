"""The reference worker: one device, one model runner.

It initialises the device through the platform, loads the model, sizes the KV cache from the
platform's memory information and ``cache.kv_cache_memory``, and executes steps. Device-specific
calls go through ``current_platform``; nothing here names a device type.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from kiln.config import KilnConfig
from kiln.distributed.parallel_state import (
    SINGLE_RANK,
    SINGLE_STAGE,
    destroy_distributed,
    init_distributed,
    init_pipeline_group,
    set_pp_group,
    set_tp_group,
)
from kiln.messages import ModelRunnerOutput, SchedulerOutput
from kiln.plugins.interfaces import resolve_class
from kiln.worker.worker_base import WorkerBase

logger = logging.getLogger(__name__)

GiB = 1 << 30
DEFAULT_KV_CACHE_FRACTION = 0.4
"""Share of the memory free after loading that the KV cache takes when not configured."""
MAX_DEFAULT_KV_CACHE_BYTES = 4 * GiB
"""Cap of the unconfigured default: host memory is shared with everything else on the machine."""


def kv_cache_budget(
    kv_cache_memory: float | None, kv_cache_memory_fraction: float | None, free_bytes: int
) -> int:
    """Bytes for the KV cache: ``kv_cache_memory`` GiB, else that fraction of the free memory,
    else the default (``DEFAULT_KV_CACHE_FRACTION`` of free, at most 4 GiB)."""
    if kv_cache_memory is not None:
        return int(kv_cache_memory * GiB)
    if kv_cache_memory_fraction is not None:
        return int(free_bytes * kv_cache_memory_fraction)
    return int(min(free_bytes * DEFAULT_KV_CACHE_FRACTION, MAX_DEFAULT_KV_CACHE_BYTES))


class Worker(WorkerBase):
    def __init__(
        self, config: KilnConfig, local_rank: int, rank: int, distributed_init_method: str
    ) -> None:
        from kiln.platforms import current_platform

        self.config = config
        self.local_rank, self.rank = local_rank, rank
        self.distributed_init_method = distributed_init_method
        self.platform = current_platform
        self.device = current_platform.get_device(local_rank)
        self.model_runner: Any = None
        self.tp_group = SINGLE_RANK
        self.pp_group = SINGLE_STAGE

    def init_device(self) -> None:
        self.platform.init_worker_process(self.config)
        self.platform.set_device(self.device)
        self.platform.seed_everything(self.config.model.seed)
        # The platform's communicator, instantiated for this rank (single-rank: none).
        self.tp_group = init_distributed(
            self.config,
            self.rank,
            self.distributed_init_method,
            self.device,
            self.platform.dist_backend,
        )
        self.pp_group = init_pipeline_group(self.config, self.rank, self.device)
        runner_cls = resolve_class("model_runner_cls", self.config.device.model_runner_cls)
        self.model_runner = runner_cls(self.config, self.device)

    def load_model(self) -> None:
        start = time.perf_counter()
        # Parallel layers take this rank's slice of every weight from the group; a pipeline
        # stage builds only its layers.
        with (
            self.platform.inference_mode(),
            set_tp_group(self.tp_group),
            set_pp_group(self.pp_group),
        ):
            self.model_runner.load_model()
        logger.info("model loaded in %.1f s", time.perf_counter() - start)

    def determine_available_memory(self) -> int:
        """The KV-cache bytes of this rank's engine: the budget (``cache.kv_cache_memory``, a
        fraction of free memory, or the default) is the whole server's, split evenly over its
        ``data_parallel_size`` engines. The engine sizes its blocks by whole-block bytes (every
        KV head), and each rank allocates only its heads' part of every block, so an engine's
        ranks together take the engine's share (more only where KV heads are replicated). The
        ranks and engines of CPU platforms draw on one host memory, so ``--kv-cache-memory 2``
        takes 2 GiB in all, whatever the parallelism."""
        free, _total = self.platform.mem_get_info(self.device)
        cache = self.config.cache
        budget = kv_cache_budget(cache.kv_cache_memory, cache.kv_cache_memory_fraction, free)
        return budget // self.config.parallel.data_parallel_size

    def initialize_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)

    def compile_or_warm_up_model(self) -> None:
        with self.platform.inference_mode():
            self.model_runner.dummy_run(min(16, self.config.scheduler.max_num_batched_tokens))
            start = time.perf_counter()
            sizes = self.model_runner.capture_model()
            if sizes:
                logger.info(
                    "graphs for decode batch sizes %s captured in %.1f s (%s)",
                    sizes,
                    time.perf_counter() - start,
                    self.config.device.graph_wrapper_cls,
                )

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        with self.platform.inference_mode():
            return self.model_runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        self.model_runner = None
        torch.set_grad_enabled(True)
        destroy_distributed()

    def get_kv_cache_bytes_per_block(self) -> int:
        return self.model_runner.get_kv_cache_bytes_per_block()

    def get_max_model_len(self) -> int:
        return self.model_runner.get_max_model_len()
