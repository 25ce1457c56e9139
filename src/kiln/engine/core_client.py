"""Clients of the engine core: in-process (offline ``LLM``) and over ZMQ to its own process.

``AsyncMPClient`` starts ``kiln.engine.core_proc.run_engine_core`` in a spawned process, sends
requests and aborts, and yields ``EngineCoreOutputs``. It watches the process: if it dies (or a
step fails), ``get_output`` raises ``EngineDeadError`` for every waiting caller and every later
call, so nothing hangs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import tempfile
import uuid
from multiprocessing.connection import wait as wait_for_sentinels

import msgspec
import zmq
import zmq.asyncio

from kiln.config import KilnConfig
from kiln.engine.core_proc import (
    ABORT,
    ADD,
    ERROR,
    OUTPUTS,
    READY,
    SHUTDOWN,
    ReadyMessage,
    StartupError,
    run_engine_core,
)
from kiln.messages import EngineCoreOutputs, EngineCoreRequest, EngineDeadError

logger = logging.getLogger(__name__)

_outputs_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
_encoder = msgspec.msgpack.Encoder()


class AsyncMPClient:
    """The engine core in a separate process.

    Args:
        config: the user's config; the engine process runs the plugin lifecycle itself.
        log_level: logging level of the engine process.
    """

    def __init__(self, config: KilnConfig, log_level: int = logging.INFO) -> None:
        self.config = config
        self.log_level = log_level
        self.ready: ReadyMessage | None = None
        self.dead_error: str | None = None
        self._ipc_dir = tempfile.mkdtemp(prefix="kiln-")
        name = uuid.uuid4().hex[:8]
        self.input_addr = f"ipc://{self._ipc_dir}/{name}-in"
        self.output_addr = f"ipc://{self._ipc_dir}/{name}-out"
        self._ctx = zmq.asyncio.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.bind(self.input_addr)
        self._output = self._ctx.socket(zmq.PULL)
        self._output.bind(self.output_addr)
        self._outputs: asyncio.Queue[EngineCoreOutputs | None] = asyncio.Queue()
        self._process: multiprocessing.process.BaseProcess | None = None
        self._tasks: list[asyncio.Task] = []
        self._closing = False

    async def start(self, timeout: float = 600) -> ReadyMessage:
        """Start the engine process and wait until its model is loaded.

        Raises:
            EngineDeadError: the process failed to start (its traceback is in the message).
        """
        ctx = multiprocessing.get_context("spawn")
        self._process = ctx.Process(
            target=run_engine_core,
            args=(self.config, self.input_addr, self.output_addr, self.log_level),
            name="kiln-engine-core",
            daemon=True,
        )
        self._process.start()
        watcher = asyncio.ensure_future(self._watch_process())
        self._tasks.append(watcher)
        receive = asyncio.ensure_future(self._output.recv_multipart())
        done, _ = await asyncio.wait(
            {receive, watcher}, timeout=timeout, return_when="FIRST_COMPLETED"
        )
        if receive not in done:
            receive.cancel()
            self.shutdown()
            raise EngineDeadError(f"the engine core did not start: {self.dead_error or 'timeout'}")
        kind, payload = receive.result()
        if kind == ERROR:
            error = msgspec.msgpack.decode(payload, type=StartupError).error
            self.shutdown()
            raise EngineDeadError(f"the engine core failed to start:\n{error}")
        assert kind == READY, kind
        self.ready = msgspec.msgpack.decode(payload, type=ReadyMessage)
        self._tasks.append(asyncio.ensure_future(self._read_outputs()))
        return self.ready

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None

    async def add_request(self, request: EngineCoreRequest) -> None:
        self._check_alive()
        await self._input.send_multipart([ADD, _encoder.encode(request)])

    async def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and not self.is_dead and not self._closing:
            await self._input.send_multipart([ABORT, _encoder.encode(request_ids)])

    async def get_output(self) -> EngineCoreOutputs:
        """The next outputs.

        Raises:
            EngineDeadError: the engine process died or failed.
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

    async def _read_outputs(self) -> None:
        while True:
            kind, payload = await self._output.recv_multipart()
            if kind != OUTPUTS:
                continue
            outputs = _outputs_decoder.decode(payload)
            if outputs.error is not None:
                self._mark_dead(f"a step failed:\n{outputs.error}")
                return
            self._outputs.put_nowait(outputs)

    async def _watch_process(self) -> None:
        assert self._process is not None
        sentinel = self._process.sentinel
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, wait_for_sentinels, [sentinel])
        self._process.join(1)  # reap it, so exitcode is known
        self._mark_dead(f"process {self._process.pid} exited with code {self._process.exitcode}")

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the engine process (politely, then by force) and close the sockets."""
        self._closing = True
        for task in self._tasks:
            task.cancel()
        process = self._process
        if process is not None and process.is_alive():
            with contextlib.suppress(zmq.ZMQError):
                self._input.send_multipart([SHUTDOWN, b""], flags=zmq.NOBLOCK)
            process.join(timeout)
            if process.is_alive():
                process.terminate()
                process.join(timeout)
            if process.is_alive():
                process.kill()
                process.join()
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._ctx.term()
        for name in os.listdir(self._ipc_dir):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self._ipc_dir, name))
        with contextlib.suppress(OSError):
            os.rmdir(self._ipc_dir)
