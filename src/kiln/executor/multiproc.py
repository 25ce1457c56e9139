"""One worker process per rank (tensor-parallel rank or pipeline stage), driven from the engine
core over ZMQ.

Contract:
- ``MultiprocExecutor(config).initialize()`` starts ``parallel.world_size`` processes
  (fresh interpreters, like the ``spawn`` start method) and waits, at most
  ``WORKER_START_TIMEOUT_S``, until every rank has joined the process group and loaded its shard.
  A rank that fails to start fails ``initialize`` with its traceback; the others are stopped.
- Each call (``execute_model`` once per step) is serialized once and the same bytes are pushed to
  every rank's socket; every rank runs it; only the output rank (``output_rank``: rank 0, or the
  last pipeline stage) answers ``execute_model`` (its sampled tokens), every rank answers the
  other calls, and any rank answers with its error. ``execute_model_async`` pushes a batch and
  returns at once: with a pipeline, up to one batch per stage is pushed before the first answer
  is read (each rank's socket keeps them in order; the answers come back in that order).
- While it waits for an answer the executor watches the processes: a rank that dies fails the
  call within ``POLL_MS`` with ``WorkerDiedError`` (the engine core then reports the error to
  every request in flight and exits, see ``kiln.engine.core_proc``). Between calls
  ``sentinels()`` (a pidfd per worker) wake the idle engine core the moment a worker exits, and
  ``check_health()`` raises ``WorkerDiedError`` for it. ``shutdown`` asks every rank
  to stop, then terminates and kills what is left: no process outlives it.
- A worker whose engine core dies (SIGKILL) notices within ``POLL_MS`` while idle and exits.

The calls are ``WorkerBase`` methods (``CALLS``); nothing else crosses. This module knows nothing
about models or scheduling. The Ray executor (``kiln.executor.ray_executor``) reuses the worker
side (``start_worker``, ``CALLS``) behind its own transport.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq

from kiln.config import KilnConfig
from kiln.distributed.parallel_state import output_rank, prepare_tensor_parallel_config
from kiln.executor import ModelOutputFuture, MultiRankExecutor, WorkerDiedError
from kiln.messages import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from kiln.worker.worker_base import WorkerBase

logger = logging.getLogger(__name__)

WORKER_START_TIMEOUT_S = 600.0
"""Longest a rank may take to start (imports, process group, model load) on a busy machine."""
POLL_MS = 100
"""How often a waiting executor checks its workers, and an idle worker its parent."""
SHUTDOWN_GRACE_S = 5.0
"""How long ``shutdown`` waits for workers to exit on request before terminating them."""

CALLS = (
    "determine_available_memory",
    "get_kv_cache_bytes_per_block",
    "get_max_model_len",
    "initialize_cache",
    "compile_or_warm_up_model",
    "execute_model",
    "shutdown",
)
"""The ``WorkerBase`` methods an executor may call on its ranks."""
READY, OK, FAILED = b"ready", b"ok", b"failed"


@dataclass
class WorkerStart:
    """What a worker process reads from its stdin at start (pickled)."""

    config: KilnConfig
    rank: int
    distributed_init_method: str
    input_addr: str
    output_addr: str
    log_level: int


class MultiprocExecutor(MultiRankExecutor):
    def __init__(self, config: KilnConfig) -> None:
        super().__init__(prepare_tensor_parallel_config(config))
        self.world_size = self.config.parallel.world_size
        self.output_rank = output_rank(self.config)
        self.processes: list[subprocess.Popen] = []
        self.ctx = zmq.Context()
        self.ipc_dir = tempfile.mkdtemp(prefix="kiln-tp-")
        self.inputs: list[zmq.Socket] = []
        self.outputs = self.ctx.socket(zmq.PULL)
        self.outputs.bind(f"ipc://{self.ipc_dir}/out")
        self.is_shut_down = False
        self._sentinels: list[int | None] = []
        self._batch_outputs: dict[int, ModelRunnerOutput] = {}
        """Answers of batches read off the socket, by batch index, until their future takes them."""
        self._num_batches_sent = 0
        self._num_batches_received = 0

    def initialize(self) -> None:
        # An offline LLM may be dropped without shutdown: stop its workers at exit all the same.
        atexit.register(self.shutdown)
        # A file store in this executor's private directory, not a TCP store: torch's TCPStore
        # listens on every interface (and has no authentication); the ranks share this node.
        init_method = f"file://{self.ipc_dir}/store"
        env = {**os.environ, **loopback_gloo_env()}
        for rank in range(self.world_size):
            push = self.ctx.socket(zmq.PUSH)
            push.bind(f"ipc://{self.ipc_dir}/in-{rank}")
            self.inputs.append(push)
            start = WorkerStart(
                self.config.replace(parallel__rank=rank),
                rank,
                init_method,
                f"ipc://{self.ipc_dir}/in-{rank}",
                f"ipc://{self.ipc_dir}/out",
                logging.getLogger().getEffectiveLevel(),
            )
            proc = subprocess.Popen(
                [sys.executable, "-c", "from kiln.executor.multiproc import main; main()"],
                stdin=subprocess.PIPE,
                env=env,
            )
            assert proc.stdin is not None
            proc.stdin.write(pickle.dumps(start))
            proc.stdin.close()
            self.processes.append(proc)
            self._sentinels.append(_pidfd(proc.pid))
        try:
            self._wait(set(range(self.world_size)), READY, WORKER_START_TIMEOUT_S, "start")
        except BaseException:
            self.shutdown()
            raise

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_model_async(scheduler_output).result()

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> ModelOutputFuture:
        self._send("execute_model", (scheduler_output,))
        self._num_batches_sent += 1
        return _BatchOutput(self, self._num_batches_sent - 1)

    def has_batch_output(self, index: int) -> bool:
        """Whether batch ``index``'s output has arrived (reads what has, never waits)."""
        return self._receive_batch_outputs(index, block=False)

    def take_batch_output(self, index: int) -> ModelRunnerOutput:
        """Batch ``index``'s output, waiting for it (see ``_receive_batch_outputs``)."""
        self._receive_batch_outputs(index, block=True)
        return self._batch_outputs.pop(index)

    def _receive_batch_outputs(self, index: int, block: bool) -> bool:
        """Read the output rank's answers, in order, until batch ``index``'s is here (without
        ``block``: only those already arrived). Returns whether it is here.

        Raises:
            WorkerDiedError: a worker exited.
            RuntimeError: a worker raised (its traceback in the message).
        """
        outputs = self._batch_outputs
        while index not in outputs:
            if not block and not self.outputs.poll(0):
                return False
            [outputs[self._num_batches_received]] = self._wait(
                {self.output_rank}, OK, None, "execute_model"
            )
            self._num_batches_received += 1
        return True

    def sentinels(self) -> list[int]:
        """A pidfd per worker process (readable once it exits), where the kernel has them."""
        return [fd for fd in self._sentinels if fd is not None]

    def check_health(self) -> None:
        """Raises ``WorkerDiedError`` when a worker process has exited."""
        if self.is_shut_down:
            raise WorkerDiedError("the workers are shut down")
        self._check_processes("idle")

    def shutdown(self) -> None:
        """Stop every worker (asked, then terminated, then killed); idempotent."""
        if self.is_shut_down:
            return
        self.is_shut_down = True
        atexit.unregister(self.shutdown)
        message = pickle.dumps(("shutdown", ()))
        for push, proc in zip(self.inputs, self.processes, strict=False):
            if proc.poll() is None:
                with contextlib.suppress(zmq.ZMQError):
                    push.send(message, flags=zmq.NOBLOCK)
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        for proc in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))
        for proc in self.processes:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.processes:
            try:
                proc.wait(2.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for fd in self._sentinels:
            if fd is not None:
                os.close(fd)
        for sock in [*self.inputs, self.outputs]:
            sock.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)

    def _call(self, method: str, *args: Any, ranks: set[int] | None = None) -> list[Any]:
        """Run ``method(*args)`` on every rank; return the answers of ``ranks`` (default: all)
        in rank order.

        Raises:
            WorkerDiedError: a worker exited.
            RuntimeError: a worker raised (its traceback in the message).
        """
        assert self._num_batches_sent == self._num_batches_received, "batches in flight"
        self._send(method, args)
        expected = set(range(self.world_size)) if ranks is None else ranks
        return self._wait(expected, OK, None, method)

    def _send(self, method: str, args: tuple) -> None:
        """Push ``method(*args)`` to every rank (serialized once)."""
        assert method in CALLS, method
        if self.is_shut_down:
            raise WorkerDiedError("the workers are shut down")
        message = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        for push in self.inputs:
            push.send(message, copy=False)

    def _wait(self, ranks: set[int], kind: bytes, timeout: float | None, what: str) -> list[Any]:
        """Answers of ``kind`` from ``ranks``, in rank order, watching the processes meanwhile."""
        answers: dict[int, Any] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(answers) < len(ranks):
            if self.outputs.poll(POLL_MS):
                rank_bytes, answer_kind, payload = self.outputs.recv_multipart()
                rank = int(rank_bytes)
                if answer_kind == FAILED:
                    raise RuntimeError(
                        f"tensor-parallel rank {rank} failed in {what}:\n" + payload.decode()
                    )
                if rank in ranks:
                    answers[rank] = pickle.loads(payload) if answer_kind == kind else None
                continue
            self._check_processes(what)
            if deadline is not None and time.monotonic() > deadline:
                missing = sorted(ranks - answers.keys())
                raise TimeoutError(
                    f"tensor-parallel ranks {missing} did not {what} within {timeout:.0f} s"
                )
        return [answers[rank] for rank in sorted(ranks)]

    def _check_processes(self, what: str) -> None:
        for rank, proc in enumerate(self.processes):
            if proc.poll() is not None:
                raise WorkerDiedError(
                    f"tensor-parallel rank {rank} (pid {proc.pid}) exited with status "
                    f"{proc.returncode} during {what}"
                )


class _BatchOutput(ModelOutputFuture):
    """Batch ``index``'s output, read off the executor's socket when asked."""

    def __init__(self, executor: MultiprocExecutor, index: int) -> None:
        self.executor, self.index = executor, index

    def done(self) -> bool:
        return self.executor.has_batch_output(self.index)

    def result(self) -> ModelRunnerOutput:
        return self.executor.take_batch_output(self.index)


def _pidfd(pid: int) -> int | None:
    """A file descriptor that becomes readable when process ``pid`` exits (Linux >= 5.3), or None
    where there is none (the engine core then notices at its next idle poll)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def loopback_gloo_env() -> dict[str, str]:
    """The environment that makes gloo bind its sockets on the loopback interface (by default it
    takes the address the host name resolves to), for ranks that all run on this node; empty
    where the user chose an interface (``GLOO_SOCKET_IFNAME``) or there is no ``lo``."""
    if "GLOO_SOCKET_IFNAME" in os.environ:
        return {}
    names = {name for _, name in socket.if_nameindex()}
    return {"GLOO_SOCKET_IFNAME": "lo"} if "lo" in names else {}


class WorkerProc:
    """The worker side: one rank's worker behind its sockets, until ``shutdown``."""

    def __init__(self, start: WorkerStart) -> None:
        self.rank = start.rank
        self.is_output_rank = start.rank == output_rank(start.config)
        self.parent_pid = os.getppid()
        self.ctx = zmq.Context()
        self.inputs = self.ctx.socket(zmq.PULL)
        self.inputs.connect(start.input_addr)
        self.outputs = self.ctx.socket(zmq.PUSH)
        self.outputs.connect(start.output_addr)
        try:
            self.worker = start_worker(
                start.config, start.rank, start.rank, start.distributed_init_method
            )
        except Exception:
            self._answer(FAILED, traceback.format_exc().encode())
            self.close()  # flushes the answer before the process exits
            raise
        self._answer(READY, pickle.dumps(None))

    def run(self) -> None:
        """Serve calls until ``shutdown`` (or until the engine core is gone)."""
        while True:
            while not self.inputs.poll(POLL_MS):
                if os.getppid() != self.parent_pid:
                    logger.warning("rank %d: the engine core is gone; exiting", self.rank)
                    return
            method, args = pickle.loads(self.inputs.recv())
            if method not in CALLS:
                raise ValueError(f"call={method!r} is invalid; allowed: {list(CALLS)}")
            try:
                result = getattr(self.worker, method)(*args)
            except Exception:
                self._answer(FAILED, traceback.format_exc().encode())
                raise
            if method == "shutdown":
                return
            if method != "execute_model" or self.is_output_rank:
                self._answer(OK, pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))

    def close(self) -> None:
        self.inputs.close(linger=0)
        self.outputs.close(linger=1000)
        self.ctx.term()

    def _answer(self, kind: bytes, payload: bytes) -> None:
        self.outputs.send_multipart([str(self.rank).encode(), kind, payload])


def start_worker(
    config: KilnConfig, rank: int, local_rank: int, distributed_init_method: str
) -> WorkerBase:
    """The platform's worker (``device.worker_cls``) for ``rank``, in this worker process: the
    process's plugin lifecycle run, the process group joined, the model (this rank's part)
    loaded. Every executor with worker processes starts its ranks with this.
    """
    from kiln.plugins import init_process
    from kiln.plugins.interfaces import resolve_class

    config = init_process("worker", config)
    worker_cls = resolve_class("worker_cls", config.device.worker_cls)
    worker = worker_cls(
        config, local_rank=local_rank, rank=rank, distributed_init_method=distributed_init_method
    )
    worker.init_device()
    worker.load_model()
    return worker


def main() -> None:
    """Entry point of a worker process: reads a pickled ``WorkerStart`` from stdin."""
    start: WorkerStart = pickle.loads(sys.stdin.buffer.read())
    logging.basicConfig(
        level=start.log_level, format=f"%(levelname)s rank{start.rank} %(name)s: %(message)s"
    )
    # Ctrl-C reaches the whole process group: the engine core stops the workers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if "OMP_NUM_THREADS" not in os.environ:
        import torch

        from kiln.platforms import worker_cpus

        # The ranks share this machine's cores: each its share, not all of them each (the
        # platform's init_worker_process may size or pin the pool again).
        torch.set_num_threads(len(worker_cpus(start.config, sorted(os.sched_getaffinity(0)))))
    try:
        proc = WorkerProc(start)
    except Exception:
        logger.exception("rank %d failed to start", start.rank)
        raise SystemExit(1) from None
    try:
        proc.run()
    except Exception:
        logger.exception("rank %d failed", start.rank)
        raise SystemExit(1) from None
    finally:
        with contextlib.suppress(Exception):
            proc.worker.shutdown()
        proc.close()


__all__ = [
    "CALLS",
    "MultiprocExecutor",
    "WorkerDiedError",
    "WorkerProc",
    "WorkerStart",
    "loopback_gloo_env",
    "main",
    "start_worker",
]
