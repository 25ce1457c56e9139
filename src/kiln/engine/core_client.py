"""Clients of the engine core: in-process (offline ``LLM``) and over ZMQ to its own processes.

``AsyncMPClient`` starts ``parallel.data_parallel_size`` engine-core processes
(``kiln.engine.core_proc.run_engine_core``, engine ``i`` with ``parallel.data_parallel_rank = i``),
sends each request to the engine with the fewest unfinished requests (ties: the lowest index),
sends an abort to the engine that has the request, and yields every engine's
``EngineCoreOutputs`` (tagged with ``engine_index``) from one queue. It watches the processes: if
any dies (or a step fails), ``get_output`` raises ``EngineDeadError`` for every waiting caller and
every later call, so nothing hangs.

Supervision: the client's background tasks (the process watcher, the output reader) are
watched; if one fails or stops while the client is not shutting down, the reason is logged and
the client is dead, exactly as for a dead engine (``/health`` answers 503 and the server exits).
A frame on the output socket that is not ``[outputs, EngineCoreOutputs]`` of a known engine (a
version skew, a bug, a local process writing to the socket) is logged and dropped, never fatal.

Stalls: every engine sends something at least once a second (outputs or a heartbeat, see
``kiln.engine.core_proc``), so ``stalled_engines`` names the engines with unfinished requests that
have been silent for longer than a timeout: stopped (SIGSTOP), swapping, or stuck in a kernel.
``/health`` answers 503 while one is (``--engine-stall-timeout``).

Sockets: one PULL socket that every engine pushes its outputs to, and one PUSH socket per engine
for its inputs.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import multiprocessing
import os
import tempfile
import time
import uuid
from collections.abc import Coroutine
from multiprocessing.connection import wait as wait_for_sentinels
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kiln.config import KilnConfig
from kiln.engine.core_proc import (
    ABORT,
    ADD,
    ERROR,
    HEARTBEAT,
    OUTPUTS,
    READY,
    SHUTDOWN,
    ReadyMessage,
    StartupError,
    run_engine_core,
)
from kiln.messages import EngineCoreOutputs, EngineCoreRequest, EngineDeadError

logger = logging.getLogger(__name__)


def _first_ready(sentinels: list[int]) -> int:
    """The first of the process ``sentinels`` to be ready (its process exited); blocks."""
    first = wait_for_sentinels(sentinels)[0]
    assert isinstance(first, int)  # wait() returns some of the objects it was given
    return first


_outputs_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
_heartbeat_decoder = msgspec.msgpack.Decoder(int)
_FRAME_DECODERS: dict[
    bytes, msgspec.msgpack.Decoder[EngineCoreOutputs] | msgspec.msgpack.Decoder[int]
] = {OUTPUTS: _outputs_decoder, HEARTBEAT: _heartbeat_decoder}
"""The decoder of each kind of frame the engines send once they are ready (``_decode``)."""
_encoder = msgspec.msgpack.Encoder()
DROPPED_FRAMES_LOGGED = 10
"""Malformed output frames logged one by one; after them, one in ``DROPPED_FRAMES_LOG_EVERY``."""
DROPPED_FRAMES_LOG_EVERY = 1000


def _describe(frames: list[bytes]) -> str:
    """What a message of unexpected shape looks like, for the log."""
    kind = frames[0][:16] if frames else b""
    return f"{len(frames)} part(s), kind {kind!r}"


class AsyncMPClient:
    """The engine cores, each in a separate process.

    Args:
        config: the user's config; each engine process runs the plugin lifecycle itself.
        log_level: logging level of the engine processes.
    """

    def __init__(self, config: KilnConfig, log_level: int = logging.INFO) -> None:
        self.config = config
        self.log_level = log_level
        self.num_engines = config.parallel.data_parallel_size
        self.readies: list[ReadyMessage] = []
        """Each engine's ``ReadyMessage``, by engine index (once ``start`` returned)."""
        self.dead_error: str | None = None
        self._ipc_dir = tempfile.mkdtemp(prefix="kiln-")
        name = uuid.uuid4().hex[:8]
        self.input_addrs = [f"ipc://{self._ipc_dir}/{name}-in-{i}" for i in range(self.num_engines)]
        self.output_addr = f"ipc://{self._ipc_dir}/{name}-out"
        self._ctx = zmq.asyncio.Context()
        self._inputs = []
        for addr in self.input_addrs:
            push = self._ctx.socket(zmq.PUSH)
            push.bind(addr)
            self._inputs.append(push)
        self._output = self._ctx.socket(zmq.PULL)
        self._output.bind(self.output_addr)
        self._outputs: asyncio.Queue[EngineCoreOutputs | None] = asyncio.Queue()
        self._processes: list[multiprocessing.process.BaseProcess] = []
        self._tasks: list[asyncio.Task] = []
        self._closing = False
        self.num_dropped_frames = 0
        """Frames on the output socket that did not decode (see ``_decode``)."""
        self.engine_of: dict[str, int] = {}
        """Engine index of every unfinished engine-core request."""
        self.num_unfinished = [0] * self.num_engines
        """Unfinished engine-core requests of each engine."""
        self.last_heard = [0.0] * self.num_engines
        """``time.monotonic()`` of each engine's latest message (outputs or heartbeat)."""

    async def start(self, timeout: float = 600) -> ReadyMessage:
        """Start the engine processes and wait until each has loaded its model; returns engine
        0's ``ReadyMessage`` (all are in ``readies``).

        Raises:
            EngineDeadError: a process failed to start (its traceback is in the message); the
                others are stopped.
        """
        ctx = multiprocessing.get_context("spawn")
        for index, input_addr in enumerate(self.input_addrs):
            config = self.config.replace(parallel__data_parallel_rank=index)
            process = ctx.Process(
                target=run_engine_core,
                args=(config, input_addr, self.output_addr, self.log_level),
                name=f"kiln-engine-core-{index}",
                daemon=True,
            )
            process.start()
            self._processes.append(process)
        watcher = self._supervise(self._watch_processes(), "engine process watcher")
        readies: dict[int, ReadyMessage] = {}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while len(readies) < self.num_engines:
            receive = asyncio.ensure_future(self._output.recv_multipart())
            done, _ = await asyncio.wait(
                {receive, watcher},
                timeout=max(0.0, deadline - loop.time()),
                return_when="FIRST_COMPLETED",
            )
            if receive not in done:
                receive.cancel()
                self.shutdown()
                reason = self.dead_error or "timeout"
                raise EngineDeadError(f"the engine core did not start: {reason}")
            message = self._decode_startup(receive.result())
            if isinstance(message, StartupError):
                self.shutdown()
                raise EngineDeadError(f"the engine core failed to start:\n{message.error}")
            if message is not None:
                readies[message.engine_index] = message
        self.readies = [readies[i] for i in range(self.num_engines)]
        self.last_heard = [time.monotonic()] * self.num_engines
        self._supervise(self._read_outputs(), "output reader")
        return self.readies[0]

    @property
    def ready(self) -> ReadyMessage | None:
        """Engine 0's ``ReadyMessage`` (None before ``start`` returned)."""
        return self.readies[0] if self.readies else None

    @property
    def pid(self) -> int | None:
        return self._processes[0].pid if self._processes else None

    @property
    def pids(self) -> list[int]:
        """Every engine process's pid, by engine index."""
        return [p.pid for p in self._processes if p.pid is not None]

    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None

    def stalled_engines(self, timeout: float) -> list[int]:
        """The engines with unfinished requests that sent nothing for more than ``timeout``
        seconds (an idle engine is never stalled: nothing waits on it)."""
        now = time.monotonic()
        return [
            engine
            for engine in range(self.num_engines)
            if self.num_unfinished[engine] and now - self.last_heard[engine] > timeout
        ]

    def pick_engine(self) -> int:
        """The engine with the fewest unfinished requests (ties: the lowest index)."""
        return min(range(self.num_engines), key=self.num_unfinished.__getitem__)

    async def add_request(self, request: EngineCoreRequest) -> None:
        self._check_alive()
        engine = self.pick_engine()
        self.engine_of[request.request_id] = engine
        self.num_unfinished[engine] += 1
        await self._inputs[engine].send_multipart([ADD, _encoder.encode(request)])

    async def abort_requests(self, request_ids: list[str]) -> None:
        """Abort ``request_ids`` on the engines that have them (unknown or finished ids are
        skipped)."""
        by_engine: dict[int, list[str]] = {}
        for request_id in request_ids:
            engine = self._forget(request_id)
            if engine is not None:
                by_engine.setdefault(engine, []).append(request_id)
        if self.is_dead or self._closing:
            return
        for engine, ids in by_engine.items():
            await self._inputs[engine].send_multipart([ABORT, _encoder.encode(ids)])

    def _forget(self, request_id: str) -> int | None:
        """Stop counting ``request_id`` as unfinished; returns its engine (None: not known)."""
        engine = self.engine_of.pop(request_id, None)
        if engine is not None:
            self.num_unfinished[engine] -= 1
        return engine

    async def get_output(self) -> EngineCoreOutputs:
        """The next outputs of any engine (``outputs.engine_index`` says which).

        Raises:
            EngineDeadError: an engine process died or failed.
        """
        self._check_alive()
        outputs = await self._outputs.get()
        if outputs is None:
            self._outputs.put_nowait(None)  # wake the next caller too
            self._check_alive()
            raise EngineDeadError("the engine core stopped")
        return outputs

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine core is dead: {self.dead_error}")

    def _mark_dead(self, reason: str) -> None:
        if self.dead_error is None and not self._closing:
            self.dead_error = reason
            logger.error("engine core is dead: %s", reason)
        self._outputs.put_nowait(None)

    def _supervise(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task:
        """Run ``coro`` as a background task whose failure or end, unless the client is
        shutting down, marks the client dead (logged with the reason)."""
        task = asyncio.ensure_future(coro)
        task.add_done_callback(functools.partial(self._on_task_done, name))
        self._tasks.append(task)
        return task

    def _on_task_done(self, name: str, task: asyncio.Task) -> None:
        if self._closing or self.dead_error is not None:
            return
        if task.cancelled():
            reason = f"the {name} was cancelled"
        elif (exc := task.exception()) is not None:
            logger.error("the %s failed", name, exc_info=exc)
            reason = f"the {name} failed: {type(exc).__name__}: {exc}"
        else:
            reason = f"the {name} stopped"
        self._mark_dead(reason)

    async def _read_outputs(self) -> None:
        while True:
            outputs = self._decode(await self._output.recv_multipart())
            if outputs is None:
                continue
            if outputs.error is not None:
                self._mark_dead(f"engine {outputs.engine_index}: a step failed:\n{outputs.error}")
                return
            for output in outputs.outputs:
                if output.finished:
                    self._forget(output.request_id)
            self._outputs.put_nowait(outputs)

    def _decode_startup(self, frames: list[bytes]) -> ReadyMessage | StartupError | None:
        """An engine's ``ready`` or ``error`` message, or None for any other frames (logged; but
        heartbeats, which an engine that is ready sends while others start, are not)."""
        if frames[:1] == [HEARTBEAT]:
            return None
        kinds = {READY: ReadyMessage, ERROR: StartupError}
        if len(frames) == 2 and frames[0] in kinds:
            try:
                message = msgspec.msgpack.decode(frames[1], type=kinds[frames[0]])
            except msgspec.DecodeError as exc:
                self._drop_frame(f"undecodable: {exc}")
                return None
            if isinstance(message, StartupError) or 0 <= message.engine_index < self.num_engines:
                return message
            self._drop_frame(f"ready from engine {message.engine_index}")
            return None
        self._drop_frame(_describe(frames))
        return None

    def _decode(self, frames: list[bytes]) -> EngineCoreOutputs | None:
        """The outputs in ``frames`` (None for a heartbeat), noting when their engine was last
        heard from; None too for frames that are not ``[outputs, EngineCoreOutputs]`` or
        ``[heartbeat, index]`` of one of the engines (logged: the first few, then one in
        ``DROPPED_FRAMES_LOG_EVERY``)."""
        decoders = _FRAME_DECODERS
        if len(frames) != 2 or frames[0] not in decoders:
            reason = _describe(frames)
        else:
            try:
                message = decoders[frames[0]].decode(frames[1])
            except msgspec.DecodeError as exc:  # ValidationError included
                reason = f"undecodable: {exc}"
            else:
                engine = message if isinstance(message, int) else message.engine_index
                if 0 <= engine < self.num_engines:
                    self.last_heard[engine] = time.monotonic()
                    return None if isinstance(message, int) else message
                reason = f"engine_index {engine} of {self.num_engines} engines"
        self._drop_frame(reason)
        return None

    def _drop_frame(self, reason: str) -> None:
        self.num_dropped_frames += 1
        count = self.num_dropped_frames
        if count <= DROPPED_FRAMES_LOGGED or count % DROPPED_FRAMES_LOG_EVERY == 0:
            logger.warning(
                "dropped a malformed frame from the engine core's output socket (%s; %d so far)",
                reason[:200],
                count,
            )

    async def _watch_processes(self) -> None:
        """Mark the client dead as soon as any engine process exits."""
        sentinels = {p.sentinel: (i, p) for i, p in enumerate(self._processes)}
        loop = asyncio.get_running_loop()
        first = await loop.run_in_executor(None, _first_ready, list(sentinels))
        index, process = sentinels[first]
        process.join(1)  # reap it, so exitcode is known
        where = f"engine {index} " if self.num_engines > 1 else ""
        self._mark_dead(f"{where}process {process.pid} exited with code {process.exitcode}")

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the engine processes (politely, then by force) and close the sockets."""
        self._closing = True
        for task in self._tasks:
            task.cancel()
        alive = [p for p in self._processes if p.is_alive()]
        for push, process in zip(self._inputs, self._processes, strict=False):
            if process.is_alive():
                with contextlib.suppress(zmq.ZMQError):
                    push.send_multipart([SHUTDOWN, b""], flags=zmq.NOBLOCK)
        for process in alive:
            process.join(timeout)
        for process in alive:
            if process.is_alive():
                process.terminate()
                process.join(timeout)
            if process.is_alive():
                process.kill()
                process.join()
        for sock in [*self._inputs, self._output]:
            sock.close(linger=0)
        self._ctx.term()
        for name in os.listdir(self._ipc_dir):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self._ipc_dir, name))
        with contextlib.suppress(OSError):
            os.rmdir(self._ipc_dir)
