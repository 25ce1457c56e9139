"""The engine core in its own process, reached over two ZMQ sockets.

The front end binds a PUSH socket (requests in) and a PULL socket (outputs out); this process
connects to both. Inputs are two-frame messages ``[kind, msgpack payload]``: ``add`` (an
``EngineCoreRequest``), ``abort`` (a list of request ids) or ``shutdown``. Outputs are
``[kind, payload]`` too: first ``ready`` (a ``ReadyMessage``) or ``error`` (a ``StartupError``),
then ``outputs`` (``EngineCoreOutputs``) and ``heartbeat`` (the engine index, msgpack). When a
step raises, the error goes out in ``EngineCoreOutputs.error`` and the process exits: the front
end then fails every waiting caller with ``EngineDeadError``.

The loop blocks on the input socket while idle (no busy polling) and drains it between steps.
Whatever it does, it sends something at least every ``HEARTBEAT_INTERVAL_S`` unless a step lasts
longer: outputs, or a ``heartbeat`` when there are none. So the front end can tell a stalled
engine (stopped, swapping, stuck in a kernel) from a busy one (``AsyncMPClient.stalled_engines``).

The API server is this process's parent. If it dies without a word (SIGKILL, OOM), this process
notices within about a second in any state, idle or busy, exits, and removes the socket directory
the parent made: the parent is checked on every step and while idle, and a send never blocks
longer than a poll interval (a dead peer stops reading, and a full queue would otherwise block
forever).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time
import traceback
from typing import Any

import msgspec
import zmq

from kiln.config import KilnConfig
from kiln.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason

logger = logging.getLogger(__name__)

ADD, ABORT, SHUTDOWN = b"add", b"abort", b"shutdown"
READY, ERROR, OUTPUTS, HEARTBEAT = b"ready", b"error", b"outputs", b"heartbeat"
IDLE_POLL_MS = 1000
SEND_POLL_MS = 1000
HEARTBEAT_INTERVAL_S = 1.0
"""Longest quiet time between two messages to the front end, steps that last longer aside."""


class ReadyMessage(msgspec.Struct):
    kv_cache_tokens: int
    max_model_len: int
    num_blocks: int
    platform: str
    pid: int
    startup_s: float = 0.0
    """``EngineCore.startup_seconds``: load, KV cache, warm-up and graph capture."""
    warmup_s: float = 0.0
    """``EngineCore.warmup_seconds``: warm-up and graph capture (compiles, if any)."""
    engine_index: int = 0
    """``parallel.data_parallel_rank`` of this engine core."""
    plugin_report: str = ""
    """``kiln plugins --json`` as this process sees it, once the engine is built: the engine
    core is where the platform acts (its worker, patches and ops), so ``GET /debug/plugins``
    shows this report rather than the API server's."""


class StartupError(msgspec.Struct):
    error: str


class ParentGone(Exception):
    """The API server that started this process has died."""


class _Parent:
    """The API server process, as seen from here: its pid at start, and whether it still lives
    (an orphan is re-parented, so ``getppid`` changes)."""

    def __init__(self) -> None:
        self.pid = os.getppid()

    def check(self) -> None:
        """Raises ``ParentGone`` when the parent has died."""
        if os.getppid() != self.pid:
            raise ParentGone(f"the API server (pid {self.pid}) is gone")


def _send(socket: zmq.Socket, frames: list[bytes], parent: _Parent) -> None:
    """Send ``frames``, waiting for room in the queue a poll interval at a time and checking the
    parent in between, so a dead reader cannot block this process forever.

    Raises:
        ParentGone: the parent died while the queue was full.
    """
    while not socket.poll(SEND_POLL_MS, zmq.POLLOUT):
        parent.check()
    socket.send_multipart(frames, flags=zmq.NOBLOCK)


def _remove_ipc_dir(*addresses: str) -> None:
    """Remove the sockets' files and the directory holding them (the dead parent cannot)."""
    paths = [a.removeprefix("ipc://") for a in addresses if a.startswith("ipc://")]
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)
    for directory in {os.path.dirname(path) for path in paths}:
        with contextlib.suppress(OSError):
            os.rmdir(directory)


encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
_abort_decoder = msgspec.msgpack.Decoder(list[str])


def run_engine_core(
    config: KilnConfig, input_addr: str, output_addr: str, log_level: int = logging.INFO
) -> None:
    """Entry point of the engine-core process (started with the ``spawn`` method)."""
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
    # SIGTERM/SIGINT go to the API server, which shuts this process down over the socket.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = _Parent()
    ctx = zmq.Context()
    inputs = ctx.socket(zmq.PULL)
    inputs.connect(input_addr)
    outputs = ctx.socket(zmq.PUSH)
    outputs.connect(output_addr)
    try:
        from kiln.engine.core import EngineCore
        from kiln.plugins import init_process

        config = init_process("engine", config)
        from kiln.platforms import current_platform  # init_process selected it

        engine = EngineCore(config)
        ready = ReadyMessage(
            engine.kv_cache_tokens,
            engine.max_model_len,
            engine.num_blocks,
            current_platform.name,
            os.getpid(),
            startup_s=engine.startup_seconds,
            warmup_s=engine.warmup_seconds,
            engine_index=config.parallel.data_parallel_rank,
            plugin_report=_plugin_report(config),
        )
        outputs.send_multipart([READY, encoder.encode(ready)])
    except Exception:
        outputs.send_multipart([ERROR, encoder.encode(StartupError(traceback.format_exc()))])
        outputs.close(linger=2000)
        ctx.term()
        raise SystemExit(1) from None
    orphaned = False
    try:
        _loop(engine, inputs, outputs, parent)
    except ParentGone as exc:
        logger.warning("%s; engine core exits", exc)
        orphaned = True
    finally:
        engine.shutdown()
        inputs.close(linger=0)
        outputs.close(linger=0 if orphaned else 2000)
        ctx.term()
        if orphaned:
            _remove_ipc_dir(input_addr, output_addr)


def _plugin_report(config: KilnConfig) -> str:
    from kiln.plugins.introspection import build_report
    from kiln.plugins.manager import get_plugin_manager

    return json.dumps(build_report(get_plugin_manager(), config))


def _loop(engine: Any, inputs: zmq.Socket, outputs: zmq.Socket, parent: _Parent) -> None:
    """Serve until ``shutdown``. Raises ``ParentGone`` when the API server dies; a failed step or
    a dead worker goes out as ``EngineCoreOutputs.error``, then raises."""
    engine_index = engine.config.parallel.data_parallel_rank
    heartbeat = [HEARTBEAT, encoder.encode(engine_index)]
    last_sent = time.monotonic()
    poller = zmq.Poller()
    poller.register(inputs, zmq.POLLIN)
    for fd in engine.sentinels():  # a worker's exit wakes the idle wait at once
        poller.register(fd, zmq.POLLIN)
    while True:
        try:
            # Wait while idle (waking each second to notice a parent that died without telling
            # us, e.g. SIGKILL, and at once when a worker dies); otherwise check the parent once
            # per step and take only what is already queued.
            if not engine.has_unfinished_requests():
                while inputs not in dict(poller.poll(IDLE_POLL_MS)):
                    parent.check()
                    engine.check_health()
                    _send(outputs, heartbeat, parent)
                    last_sent = time.monotonic()
            parent.check()
            while inputs.poll(0):
                kind, payload = inputs.recv_multipart()
                if kind == ADD:
                    _add_request(engine, _request_decoder.decode(payload), outputs, parent)
                elif kind == ABORT:
                    engine.abort_requests(_abort_decoder.decode(payload))
                elif kind == SHUTDOWN:
                    return
            step_outputs = engine.step()
        except ParentGone:
            raise
        except Exception:
            error = traceback.format_exc()
            logger.error("engine core step failed:\n%s", error)
            failed = EngineCoreOutputs(
                error=error, timestamp=time.monotonic(), engine_index=engine_index
            )
            _send(outputs, [OUTPUTS, encoder.encode(failed)], parent)
            raise
        if step_outputs.outputs or step_outputs.scheduler_stats is not None:
            step_outputs.engine_index = engine_index
            _send(outputs, [OUTPUTS, encoder.encode(step_outputs)], parent)
            last_sent = time.monotonic()
        elif time.monotonic() - last_sent >= HEARTBEAT_INTERVAL_S:
            _send(outputs, heartbeat, parent)
            last_sent = time.monotonic()


def _add_request(
    engine: Any, request: EngineCoreRequest, outputs: zmq.Socket, parent: _Parent
) -> None:
    """Queue ``request``; one the scheduler refuses finishes at once with an error, instead of
    taking the engine down (the front end validates first, so this is a guard)."""
    try:
        engine.add_request(request)
    except ValueError as exc:
        logger.error("request %s refused: %s", request.request_id, exc)
        refused = EngineCoreOutput(
            request.request_id, [], finish_reason=FinishReason.ERROR, stop_reason=str(exc)
        )
        result = EngineCoreOutputs(
            outputs=[refused],
            timestamp=time.monotonic(),
            engine_index=engine.config.parallel.data_parallel_rank,
        )
        _send(outputs, [OUTPUTS, encoder.encode(result)], parent)
