"""``AsyncLLM``: the asyncio front end the API server uses; the engine core runs in its own
process, or ``parallel.data_parallel_size`` engine cores each in its own (``AsyncMPClient``
routes the requests; ``stats.engines`` keeps each engine's statistics).

``generate()`` admits the request at once (refusals raise before it returns, so a server can
answer an error status before its response starts) and returns an async iterator of
``RequestOutput``s (delta or cumulative, as the params' ``output_kind`` says); closing it early
(``aclose()``, or cancelling the task that iterates, as the server does when a client
disconnects) aborts the request in the engine core and frees its KV
blocks. ``abort(request_id)`` from elsewhere (a server shutting
down) ends that request's ``generate()`` with a last output whose unfinished completions have
finish_reason ``"abort"``. A request the engine failed on its own (finish reason ``"error"``:
its adapter, its grammar) raises ``RequestFailedError`` from its iterator. One background task
reads engine-core outputs, runs the output processor and hands each output to its request's
queue, yielding to the event loop between slices of a large step. If the engine core dies
(or the client's output reader does), every waiting ``generate()`` raises ``EngineDeadError``,
the gauges read zero and ``wait_until_dead()`` returns.

``max_num_waiting`` counts the requests the scheduler reports waiting plus those sent since its
last report that will not fit the free batch slots (``max_num_seqs`` per engine less the running
ones).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from kiln.config import KilnConfig
from kiln.engine.core_client import AsyncMPClient
from kiln.engine.frontend import Frontend, pooling_sampling_params
from kiln.engine.input_processor import PromptType
from kiln.engine.stats import IterationStats, StatsRecorder
from kiln.messages import (
    KV_LOAD_FAILED,
    EngineCoreRequest,
    EngineDeadError,
    FinishReason,
    KVLoadFailedError,
    RequestFailedError,
)
from kiln.outputs import RequestOutput
from kiln.pooling_params import PoolingParams
from kiln.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


OUTPUT_SLICE = 64
"""Requests handed their outputs between two yields to the event loop."""


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
        self.stats = StatsRecorder(
            10.0 if log_stats else 0.0, num_engines=config.parallel.data_parallel_size
        )
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._num_core_requests: dict[str, int] = {}
        """Engine-core requests (``n`` each) of every admitted request."""
        self._dead = asyncio.Event()
        self._background: set[asyncio.Task] = set()
        self._is_shut_down = False
        self._output_task = asyncio.ensure_future(self._run_output_handler())
        self.num_kv_cache_tokens = sum(ready.kv_cache_tokens for ready in client.readies)

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
        try:
            ready = await client.start()
        except EngineDeadError:
            raise  # start() has cleaned up
        except BaseException:  # cancelled (e.g. SIGTERM while the model loads): stop the process
            client.shutdown()
            raise
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

    def generate(
        self,
        prompt: PromptType | EngineCoreRequest,
        sampling_params: SamplingParams,
        request_id: str,
        priority: int = 0,
        pooling_params: PoolingParams | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Admit the request now; the returned iterator sends it to the engine core and yields
        its outputs until it finishes. Iterate it, or drop an admitted request with
        ``release(request_id)``. A pooling request has ``pooling_params`` (see ``encode``).
        ``prompt`` may be the ``EngineCoreRequest`` that ``frontend.input_processor.process``
        made of it (then it is not processed again).

        Raises (here, not when iterating):
            ValueError: invalid prompt or params, or ``request_id`` already running.
            QueueFullError: ``scheduler.max_num_waiting`` requests are already waiting.
            EngineDeadError: the engine core died (also raised while iterating).

        Raises (when iterating):
            RequestFailedError: the engine failed this request (finish reason "error").
        """
        self.client._check_alive()
        if self.is_queue_full():
            limit = self.config.scheduler.max_num_waiting
            raise QueueFullError(f"{limit} requests are already waiting")
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is already running")
        requests = self.frontend.make_requests(
            request_id, prompt, sampling_params, priority, pooling_params=pooling_params
        )
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = queue
        self._num_core_requests[request_id] = len(requests)
        return self._run(request_id, requests, queue)

    def encode(
        self, prompt: PromptType, pooling_params: PoolingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """A pooling request (``--runner pooling``), admitted now as ``generate`` admits: its one
        output is final and carries its vector in ``RequestOutput.pooled``."""
        return self.generate(
            prompt, pooling_sampling_params(), request_id, pooling_params=pooling_params
        )

    def release(self, request_id: str) -> None:
        """Drop an admitted request whose iterator was never iterated."""
        self.frontend.output_processor.abort_requests([request_id])
        self._queues.pop(request_id, None)
        self._num_core_requests.pop(request_id, None)

    async def _run(
        self,
        request_id: str,
        requests: list[EngineCoreRequest],
        queue: asyncio.Queue[RequestOutput | BaseException],
    ) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            for request in requests:
                await self.client.add_request(request)
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                error = next((c for c in item.outputs if c.finish_reason == "error"), None)
                if error is not None:  # its siblings (n > 1) are aborted below
                    reason = str(error.stop_reason)
                    failure = KVLoadFailedError if reason == KV_LOAD_FAILED else RequestFailedError
                    raise failure(reason)
                finished = item.finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            self._num_core_requests.pop(request_id, None)
            if not finished:
                # No await here: a cancelled caller (e.g. in an anyio cancel scope) could be
                # cancelled again at the await, and the engine core would never hear of it.
                self._abort_nowait(request_id)

    def is_queue_full(self) -> bool:
        """Whether ``scheduler.max_num_waiting`` requests already wait (a new one is refused)."""
        limit = self.config.scheduler.max_num_waiting
        return limit is not None and self.num_waiting_estimate() >= limit

    def num_waiting_estimate(self) -> int:
        """Engine-core requests waiting: those the scheduler last reported, plus those sent
        since that will not fit the batch slots the scheduler has free."""
        totals = self.stats.totals
        num_sent = sum(self._num_core_requests.values())
        unreported = max(0, num_sent - totals.num_running - totals.num_waiting)
        slots = self.config.scheduler.max_num_seqs * self.config.parallel.data_parallel_size
        free_slots = max(0, slots - totals.num_running)
        return totals.num_waiting + max(0, unreported - free_slots)

    async def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks (no-op when it already finished).

        A ``generate()`` waiting for this request's outputs yields a last output whose unfinished
        completions have finish_reason ``"abort"`` (``OutputProcessor.make_abort_output``), then
        ends.
        """
        aborted = self.frontend.output_processor.make_abort_output(request_id)
        core_ids = self._abort_tracked(request_id)
        queue = self._queues.pop(request_id, None)
        self._num_core_requests.pop(request_id, None)
        if queue is not None and aborted is not None:
            queue.put_nowait(aborted)
        if core_ids and not self._is_shut_down:
            await self.client.abort_requests(core_ids)

    def _abort_nowait(self, request_id: str) -> None:
        """``abort()`` for a ``generate()`` that is closing: the message goes out from a task."""
        core_ids = self._abort_tracked(request_id)
        if core_ids and not self._is_shut_down:
            task = asyncio.ensure_future(self.client.abort_requests(core_ids))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    def _abort_tracked(self, request_id: str) -> list[str]:
        """Stop tracking ``request_id`` in the output processor, counting each engine-core
        request it still had as finished with reason "abort"; returns their ids."""
        stats = IterationStats(iteration_timestamp=time.time())
        core_ids = self.frontend.output_processor.abort_requests(
            [request_id], stats, FinishReason.ABORT
        )
        if stats.finished_requests:
            engine = self.client.engine_of.get(core_ids[0], 0) if core_ids else 0
            self.stats.record(None, stats, engine_index=engine)
        return core_ids

    async def _run_output_handler(self) -> None:
        output_processor = self.frontend.output_processor
        try:
            while True:
                outputs = await self.client.get_output()
                # A large step is processed in slices, yielding between them, so that a step
                # with many requests (or costly stop strings) never holds the event loop long.
                core_outputs = outputs.outputs
                for start in range(0, max(len(core_outputs), 1), OUTPUT_SLICE):
                    if start:
                        await asyncio.sleep(0)
                    processed = output_processor.process_outputs(
                        core_outputs[start : start + OUTPUT_SLICE]
                    )
                    for output in processed.request_outputs:
                        queue = self._queues.get(output.request_id)
                        if queue is not None:
                            queue.put_nowait(output)
                    if processed.reqs_to_abort:
                        await self.client.abort_requests(processed.reqs_to_abort)
                    last = start + OUTPUT_SLICE >= len(core_outputs)
                    scheduler_stats = outputs.scheduler_stats if last else None
                    self.stats.record(
                        scheduler_stats,
                        processed.iteration_stats,
                        engine_index=outputs.engine_index,
                    )
        except EngineDeadError as exc:
            self._on_dead()
            for queue in self._queues.values():
                queue.put_nowait(exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must not leave callers waiting forever
            logger.exception("output handler failed")
            dead = EngineDeadError(f"output handler failed: {exc}")
            self.client._mark_dead(str(dead))
            self._on_dead()
            for queue in self._queues.values():
                queue.put_nowait(dead)

    def _on_dead(self) -> None:
        # Nothing runs or waits any more: the gauges must not keep their last values.
        self.stats.reset_gauges()
        self._dead.set()

    async def wait_until_dead(self) -> None:
        """Return once the engine core is dead (and every waiting caller has been told)."""
        await self._dead.wait()

    async def wait_until_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight, at most ``timeout`` seconds; True if idle."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._queues and loop.time() < deadline:
            await asyncio.sleep(0.05)
        return not self._queues

    def shutdown(self) -> None:
        self._is_shut_down = True
        self._output_task.cancel()
        for task in self._background:
            task.cancel()
        self.client.shutdown()
