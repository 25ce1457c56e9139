"""One worker in the engine core's process (tensor_parallel_size == 1)."""

from __future__ import annotations

from kiln.config import KilnConfig
from kiln.executor import Executor
from kiln.messages import ModelRunnerOutput, SchedulerOutput
from kiln.plugins.interfaces import resolve_class


class UniProcExecutor(Executor):
    def __init__(self, config: KilnConfig) -> None:
        super().__init__(config)
        worker_cls = resolve_class("worker_cls", config.device.worker_cls)
        self.worker = worker_cls(config, local_rank=0, rank=0, distributed_init_method="")

    def initialize(self) -> None:
        from kiln.plugins.manager import get_plugin_manager

        get_plugin_manager().init_worker()  # worker-scope patches, in this (the worker's) process
        self.worker.init_device()
        self.worker.load_model()

    def determine_available_memory(self) -> list[int]:
        return [self.worker.determine_available_memory()]

    def get_kv_cache_bytes_per_block(self) -> int:
        return self.worker.get_kv_cache_bytes_per_block()

    def get_max_model_len(self) -> int:
        return self.worker.get_max_model_len()

    def initialize_cache(self, num_blocks: int) -> None:
        self.worker.initialize_cache(num_blocks)
        self.worker.compile_or_warm_up_model()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def shutdown(self) -> None:
        self.worker.shutdown()
