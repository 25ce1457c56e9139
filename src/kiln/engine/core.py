"""The engine core: a scheduler, an executor, and a loop of three calls.

``step()`` is schedule -> execute -> update: features live inside the scheduler and the model
runner, never as branches here. With a pipeline (``executor.max_concurrent_batches > 1``) a step
is one of the two halves instead (vLLM's batch queue): schedule a batch and hand it over without
waiting, while the queue has room and the oldest batch is not back; else apply the oldest
batch's output, waiting for it. Outputs are applied in the order the batches were scheduled; the
scheduler does not schedule a request whose batch is in flight.

The engine core is token ids in, token ids out; it knows nothing about text. ``EngineCore`` runs
in-process (offline ``LLM``) or inside ``EngineCoreProc`` (a separate process that ``kiln serve``
talks to over ZMQ).
"""

from __future__ import annotations

import logging
import time
from collections import deque

from kiln.config import KilnConfig
from kiln.executor import Executor, ModelOutputFuture
from kiln.messages import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    EngineCoreOutputs,
    EngineCoreRequest,
    SchedulerOutput,
    SchedulerStats,
)
from kiln.plugins.interfaces import resolve_class, resolve_named_classes
from kiln.scheduler.request import Request, RequestStatus

logger = logging.getLogger(__name__)


class EngineCore:
    """Builds the executor (workers, model, KV cache) and the scheduler, then steps them.

    Args:
        config: the platform-updated config (``init_process`` has run in this process).
    """

    def __init__(self, config: KilnConfig) -> None:
        start = time.perf_counter()
        # Every class the platform named, checked before any is used (some are used late).
        resolve_named_classes(config)
        self.executor = Executor.get_class(config)(config)
        self.executor.initialize()
        max_model_len = self.executor.get_max_model_len()
        bytes_per_block = self.executor.get_kv_cache_bytes_per_block()
        config = config.replace(
            model__max_model_len=max_model_len, cache__bytes_per_block=bytes_per_block
        )
        available = min(self.executor.determine_available_memory())
        num_blocks = available // bytes_per_block
        min_blocks = -(-max_model_len // config.cache.block_size)
        if num_blocks < 1:
            raise ValueError(
                f"cache.kv_cache_memory leaves room for no KV-cache block ({available} bytes, "
                f"{bytes_per_block} bytes per block); give the KV cache more memory"
            )
        self.num_blocks = num_blocks
        warmup_start = time.perf_counter()
        self.executor.initialize_cache(num_blocks)  # also warms up and captures graphs
        # Shown in kiln serve's banner: capture may compile for minutes on a first start.
        self.warmup_seconds = time.perf_counter() - warmup_start
        self.config = config
        scheduler_cls = resolve_class("scheduler_cls", config.device.scheduler_cls)
        self.scheduler = scheduler_cls(config, num_blocks)
        self.max_concurrent_batches = self.executor.max_concurrent_batches
        self.batch_queue: deque[tuple[SchedulerOutput, ModelOutputFuture]] | None = None
        """Batches in flight, oldest first (None: one step at a time)."""
        if self.max_concurrent_batches > 1:
            self.batch_queue = deque()
        self.max_num_batches_in_flight = 0
        """The most batches that were in flight at once (a high-water mark)."""
        num_tokens = num_blocks * config.cache.block_size
        logger.info(
            "KV cache: %d tokens, maximum concurrency at max_model_len: %.2fx",
            num_tokens,
            num_tokens / max_model_len,
        )
        if num_blocks < min_blocks:
            logger.warning(
                "the KV cache (%d tokens) cannot hold one request of max_model_len=%d tokens",
                num_tokens,
                max_model_len,
            )
        self.startup_seconds = time.perf_counter() - start  # load, KV cache, warm-up, capture
        logger.info(
            "engine core ready in %.1f s (warm-up and graph capture %.1f s)",
            self.startup_seconds,
            self.warmup_seconds,
        )

    @property
    def max_model_len(self) -> int:
        assert self.config.model.max_model_len is not None
        return self.config.model.max_model_len

    @property
    def kv_cache_tokens(self) -> int:
        return self.num_blocks * self.config.cache.block_size

    def add_request(self, request: EngineCoreRequest) -> None:
        self.scheduler.add_request(Request.from_engine_core_request(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        """Unfinished requests, or batches in flight whose outputs are still to be applied."""
        return self.scheduler.has_unfinished_requests() or bool(self.batch_queue)

    def sentinels(self) -> list[int]:
        """File descriptors that become readable when a worker process dies (see
        ``Executor.sentinels``); an idle loop waits on them with its input."""
        return self.executor.sentinels()

    def check_health(self) -> None:
        """Raises ``WorkerDiedError`` when a worker process has died."""
        self.executor.check_health()

    def step(self) -> EngineCoreOutputs:
        """Run one step; returns the outputs of the requests that advanced or finished."""
        if self.batch_queue is not None:
            return self._step_with_batch_queue(self.batch_queue)
        if not self.scheduler.has_unfinished_requests():
            # Idle (e.g. the last request was just aborted): report it, or the front end's gauges
            # (running, waiting, KV-cache usage) would keep the last busy step's values.
            return EngineCoreOutputs(scheduler_stats=SchedulerStats(), timestamp=time.monotonic())
        scheduler_output = self.scheduler.schedule()
        model_output = self.executor.execute_model(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, model_output)

    def _step_with_batch_queue(
        self, queue: deque[tuple[SchedulerOutput, ModelOutputFuture]]
    ) -> EngineCoreOutputs:
        """Hand over a new batch, or apply the oldest one's output (see the module docstring)."""
        scheduler = self.scheduler
        if len(queue) < self.max_concurrent_batches and scheduler.has_unfinished_requests():
            scheduler_output = scheduler.schedule()
            # A step of finished requests only still goes out: the runners drop their state.
            if scheduler_output.total_num_scheduled_tokens or scheduler_output.finished_req_ids:
                queue.append(
                    (scheduler_output, self.executor.execute_model_async(scheduler_output))
                )
                self.max_num_batches_in_flight = max(self.max_num_batches_in_flight, len(queue))
                if len(queue) < self.max_concurrent_batches and not queue[0][1].done():
                    return EngineCoreOutputs(timestamp=time.monotonic())  # nothing back yet
            elif not queue:  # nothing to run: ignored requests, failed grammars, idle
                return scheduler.update_from_output(scheduler_output, EMPTY_MODEL_RUNNER_OUTPUT)
        if not queue:
            return EngineCoreOutputs(scheduler_stats=SchedulerStats(), timestamp=time.monotonic())
        scheduler_output, future = queue.popleft()
        return scheduler.update_from_output(scheduler_output, future.result())

    def shutdown(self) -> None:
        self.executor.shutdown()
