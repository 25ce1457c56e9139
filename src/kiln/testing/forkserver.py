"""Fresh Python processes without paying for the torch import each time: a fork server.

A test that runs ``python ARGS`` (``run_python``, ``kiln.testing.server.KilnServer``) pays about
2 s of interpreter start and ``import torch`` before its command does anything; Kiln's own suite
starts a few hundred such processes. ``ForkServer`` keeps one process per test process that has
imported torch, transformers' tokenizers and the HTTP server (``PRELOAD``) and nothing of Kiln,
and forks it for each command: the child sets the command's environment, working directory and
standard streams, then runs ``-m MODULE``, ``-c CODE`` or a script the way the interpreter would,
and exits as the interpreter would (atexit handlers, the exit status of ``SystemExit``, a
traceback and status 1 for an uncaught exception).

A command is forked only when nothing read at interpreter start or while the preloaded modules
import differs from the server's own environment (``PYTHON*``, ``LD_*``, OpenMP and BLAS
variables, Hugging Face's, ...) and its arguments are one of those three forms; otherwise
``popen`` starts it the ordinary way. Set ``KILN_TEST_FORK_SERVER=0`` to start every command
the ordinary way.

The server (this file, run as a script) uses only the standard library until it imports what it
preloads.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from typing import IO, Any

DISABLE_ENV = "KILN_TEST_FORK_SERVER"
PRELOAD = ("torch", "transformers.tokenization_utils_fast", "fastapi", "uvicorn")
"""What the server imports before it forks (about 1 s of a ``kiln serve`` start besides torch's
1.3 s): third-party only, never Kiln (whose modules read ``KILN_*`` variables, which tests
vary)."""

# Variables read at interpreter start-up or while the preloaded modules import: a command that
# changes one of these gets a process started the ordinary way.
_STARTUP_PREFIXES = (
    "PYTHON",
    "LD_",
    "OMP_",
    "KMP_",
    "GOMP_",
    "MKL_",
    "OPENBLAS_",
    "TORCH",
    "HF_",
    "HUGGINGFACE",
    "TRANSFORMERS",
    "TOKENIZERS",
    "ATEN_",
    "DNNL_",
    "ONEDNN_",
    "CUDA",
    "MALLOC_",
    "GLIBC_",
    "LC_",
    "LANG",
)

_STATUS = struct.Struct("!qi")  # (pid, wait status); a pid-only message has status -1


def _startup_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_STARTUP_PREFIXES)}


def _forkable(args: Sequence[str]) -> bool:
    """``-m MODULE ...``, ``-c CODE ...`` or ``SCRIPT ...``: the forms the child can run."""
    if not args:
        return False
    if args[0] in ("-m", "-c"):
        return len(args) >= 2
    return not args[0].startswith("-")


class ForkedProcess:
    """The subset of ``subprocess.Popen`` that tests use, for a child of the fork server: it is
    not this process's child, so its exit status comes over the server's connection."""

    def __init__(self, args: list[str], conn: socket.socket, pid: int) -> None:
        self.args = args
        self.pid = pid
        self.returncode: int | None = None
        self._conn = conn

    def _receive(self, timeout: float | None) -> bool:
        if self.returncode is not None:
            return True
        ready, _, _ = select.select([self._conn], [], [], timeout)
        if not ready:
            return False
        data = _recv_exactly(self._conn, _STATUS.size)
        self._conn.close()
        if data is None:  # the server died: the child's fate is unknown
            self.returncode = -signal.SIGKILL
        else:
            self.returncode = os.waitstatus_to_exitcode(_STATUS.unpack(data)[1])
        return True

    def poll(self) -> int | None:
        self._receive(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._receive(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _recv_exactly(conn: socket.socket, size: int) -> bytes | None:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


class ForkServer:
    """One fork server per process that uses it (started at first use; a forked or xdist child
    process starts its own), stopped when this process exits."""

    def __init__(self, preload: Sequence[str] = PRELOAD) -> None:
        self.preload = list(preload)
        self._proc: subprocess.Popen[bytes] | None = None
        self._owner = -1
        self._address = ""
        self._env: dict[str, str] = {}
        self._lock = threading.Lock()

    def _ensure_started(self) -> None:
        if self._proc is not None and self._owner == os.getpid() and self._proc.poll() is None:
            return
        directory = tempfile.mkdtemp(prefix="kiln-forkserver-")
        self._address = os.path.join(directory, "socket")
        self._env = dict(os.environ)
        # Its stdin is a pipe from this process: at EOF (this process exited) it exits.
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _BOOT, __file__, self._address, json.dumps(self.preload)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=self._env,
        )
        self._owner = os.getpid()
        assert self._proc.stdout is not None
        if self._proc.stdout.readline().strip() != b"ready":
            raise RuntimeError(f"the fork server did not start (status {self._proc.wait()})")

    def accepts(self, args: Sequence[str], env: dict[str, str]) -> bool:
        """Whether ``python ARGS`` in ``env`` may be forked from the server (see the module)."""
        if env.get(DISABLE_ENV) == "0" or not _forkable(args):
            return False
        reference = self._env if self._owner == os.getpid() else os.environ
        return _startup_env(env) == _startup_env(dict(reference))

    def spawn(
        self,
        args: Sequence[str],
        env: dict[str, str],
        stdout: IO[Any] | int,
        stderr: IO[Any] | int,
        new_session: bool = False,
    ) -> ForkedProcess:
        """Fork ``python ARGS`` with ``env`` and the current working directory; ``stdout`` and
        ``stderr`` are open files (or descriptors) the child writes to, stdin is /dev/null."""
        with self._lock:
            self._ensure_started()
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.connect(self._address)
        request = json.dumps(
            {"args": list(args), "env": env, "cwd": os.getcwd(), "new_session": new_session}
        ).encode()
        fds = [f if isinstance(f, int) else f.fileno() for f in (stdout, stderr)]
        socket.send_fds(conn, [struct.pack("!q", len(request)) + request], fds)
        data = _recv_exactly(conn, _STATUS.size)
        if data is None:
            raise RuntimeError("the fork server closed the connection before forking")
        return ForkedProcess([sys.executable, *args], conn, _STATUS.unpack(data)[0])


FORK_SERVER = ForkServer()


def popen(
    args: Sequence[str],
    env: dict[str, str],
    stdout: IO[Any] | int,
    stderr: IO[Any] | int,
    new_session: bool = False,
) -> ForkedProcess | subprocess.Popen[Any]:
    """``python ARGS`` in ``env``: forked from ``FORK_SERVER`` when it accepts the command, else
    started as ``subprocess.Popen`` would (stdin /dev/null in both cases)."""
    if FORK_SERVER.accepts(args, env):
        return FORK_SERVER.spawn(args, env, stdout, stderr, new_session)
    return subprocess.Popen(
        [sys.executable, *args],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
        start_new_session=new_session,
    )


# --- the server side: runs in the fork server's own process ------------------------------------

_BOOT = (
    "import runpy, sys; job = runpy.run_path(sys.argv[1], run_name='kiln_fork_server')['JOB']; "
    "del runpy; job()"
)
"""The server's command: run this file (which serves, and in a forked child returns the job),
then run the child's job at the top level, where ``SystemExit`` and uncaught exceptions end the
process exactly as they end ``python ARGS``."""


def _serve(address: str, preload: list[str]) -> dict[str, Any]:
    """Serve until stdin closes; in each forked child, return its request."""
    for name in preload:
        __import__(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(64)
    sys.stdout.buffer.write(b"ready\n")
    sys.stdout.flush()
    open_conns: set[socket.socket] = set()
    while True:
        ready, _, _ = select.select([listener, sys.stdin], [], [])
        if sys.stdin in ready:  # the process that started it exited
            with contextlib.suppress(OSError):
                os.unlink(address)
                os.rmdir(os.path.dirname(address))
            os._exit(0)
        conn, _ = listener.accept()
        request = _read_request(conn)
        if request is None:  # the client went away mid-request
            conn.close()
            continue
        pid = os.fork()
        if pid == 0:
            listener.close()
            for other in open_conns:
                other.close()
            conn.close()
            return request
        for fd in request["fds"]:
            os.close(fd)
        conn.sendall(_STATUS.pack(pid, -1))
        open_conns.add(conn)
        threading.Thread(target=_report_exit, args=(conn, pid, open_conns), daemon=True).start()


def _read_request(conn: socket.socket) -> dict[str, Any] | None:
    """A request's JSON (length-prefixed) with the descriptors that came with it as ``fds``;
    None when the client closed the connection first."""
    start, fds, _, _ = socket.recv_fds(conn, 8, 2)
    rest = _recv_exactly(conn, 8 - len(start))
    body = None if rest is None else _recv_exactly(conn, struct.unpack("!q", start + rest)[0])
    if body is None:
        for fd in fds:
            os.close(fd)
        return None
    return {**json.loads(body), "fds": fds}


def _report_exit(conn: socket.socket, pid: int, open_conns: set[socket.socket]) -> None:
    _, status = os.waitpid(pid, 0)
    with contextlib.suppress(OSError):
        conn.sendall(_STATUS.pack(pid, status))
    open_conns.discard(conn)
    conn.close()


def _job(request: dict[str, Any]) -> Any:
    """In the forked child: the request's environment and streams, then a function that runs its
    command."""
    import runpy
    import types

    stdout, stderr = request["fds"]
    devnull = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((devnull, 0), (stdout, 1), (stderr, 2)):
        os.dup2(fd, target)
        os.close(fd)
    if request["new_session"]:
        os.setsid()
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    args = request["args"]

    def run() -> None:
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        elif args[0] == "-c":
            sys.argv = ["-c", *args[2:]]
            sys.path[0] = ""
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(args[1], "<string>", "exec"), main.__dict__)
        else:
            sys.argv = list(args)
            sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
            runpy.run_path(args[0], run_name="__main__")

    return run


if __name__ == "kiln_fork_server":
    JOB = _job(_serve(sys.argv[2], json.loads(sys.argv[3])))
