"""``AsyncLLM``: the asyncio front door the API server uses; the engine core runs in its own
process (``AsyncMPClient``).

``generate()`` is an async iterator of ``RequestOutput``s (delta or cumulative, as the params'
``output_kind`` says); breaking out of it, or cancelling the task that iterates, aborts the request
in the engine core and frees its KV blocks. One background task reads engine-core outputs, runs
the output processor and hands each output to its request's queue. If the engine core dies, every
waiting ``generate()`` raises ``EngineDeadError``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from kiln.config import KilnConfig
from kiln.engine import EngineDeadError
from kiln.engine.core_client import AsyncMPClient
from kiln.engine.frontend import Frontend
from kiln.engine.input_processor import PromptType
from kiln.engine.stats import StatsRecorder
from kiln.outputs import RequestOutput
from kiln.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """``max_num_waiting`` requests are already queued (the server answers HTTP 503)."""


class AsyncLLM:
    """Create with ``await AsyncLLM.create(config)``; close with ``shutdown()``."""

    def __init__(
        self,
        config: KilnConfig,
        client: AsyncMPClient,
        frontend: Frontend,
        log_stats: bool = True,
    ) -> None:
        self.config = config
        self.client = client
        self.frontend = frontend
        self.model_name = frontend.model_name
        self.stats = StatsRecorder(10.0 if log_stats else 0.0)
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._output_task = asyncio.ensure_future(self._run_output_handler())
        self.num_kv_cache_tokens = client.ready.kv_cache_tokens if client.ready else 0

    @classmethod
    async def create(
        cls, config: KilnConfig, log_level: int = logging.INFO, log_stats: bool = True
    ) -> AsyncLLM:
        """Start the engine-core process, wait for the model, and build the front end.

        ``config`` is the platform-updated config of this (the API server's) process; the engine
        process runs the plugin lifecycle again for itself.

        Raises:
            EngineDeadError: the engine core failed to start.
        """
        client = AsyncMPClient(config, log_level)
        ready = await client.start()
        try:
            frontend = await asyncio.get_running_loop().run_in_executor(
                None, Frontend, config, ready.max_model_len
            )
        except BaseException:
            client.shutdown()
            raise
        return cls(config, client, frontend, log_stats)

    @property
    def is_dead(self) -> bool:
        return self.client.is_dead

    @property
    def max_model_len(self) -> int:
        return self.frontend.max_model_len

    def num_unfinished_requests(self) -> int:
        return len(self._queues)

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes.

        Raises:
            ValueError: invalid prompt or params (before anything is queued).
            QueueFullError: ``scheduler.max_num_waiting`` requests are already waiting.
            EngineDeadError: the engine core died.
        """
        self.client._check_alive()
        limit = self.config.scheduler.max_num_waiting
        if limit is not None and self.stats.totals.num_waiting + self._num_unscheduled() >= limit:
            raise QueueFullError(f"{limit} requests are already waiting")
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is already running")
        requests = self.frontend.make_requests(request_id, prompt, sampling_params, priority)
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = queue
        finished = False
        try:
            for request in requests:
                await self.client.add_request(request)
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                await self.abort(request_id)

    def _num_unscheduled(self) -> int:
        # Requests sent since the scheduler's last report: count them as waiting.
        totals = self.stats.totals
        return max(0, len(self._queues) - totals.num_running - totals.num_waiting)

    async def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks (no-op when it already finished)."""
        core_ids = self.frontend.output_processor.abort_requests([request_id])
        self._queues.pop(request_id, None)
        if core_ids:
            await self.client.abort_requests(core_ids)

    async def _run_output_handler(self) -> None:
        try:
            while True:
                outputs = await self.client.get_output()
                processed = self.frontend.output_processor.process_outputs(outputs.outputs)
                for output in processed.request_outputs:
                    queue = self._queues.get(output.request_id)
                    if queue is not None:
                        queue.put_nowait(output)
                if processed.reqs_to_abort:
                    await self.client.abort_requests(processed.reqs_to_abort)
                self.stats.record(outputs.scheduler_stats, processed.iteration_stats)
        except EngineDeadError as exc:
            for queue in self._queues.values():
                queue.put_nowait(exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must not leave callers waiting forever
            logger.exception("output handler failed")
            dead = EngineDeadError(f"output handler failed: {exc}")
            self.client._mark_dead(str(dead))
            for queue in self._queues.values():
                queue.put_nowait(dead)

    async def wait_until_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight, at most ``timeout`` seconds; True if idle."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._queues and loop.time() < deadline:
            await asyncio.sleep(0.05)
        return not self._queues

    def shutdown(self) -> None:
        self._output_task.cancel()
        self.client.shutdown()
