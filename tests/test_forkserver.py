"""``kiln.testing.forkserver``: a forked command behaves as ``python ARGS`` would (arguments,
environment, working directory, streams, exit status, atexit, sessions, timeouts), and a command
whose start-up environment differs is started the ordinary way."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from kiln.testing import forkserver, run_python

# Prints whether torch was imported before the command ran: True only in a forked child.
PREIMPORTED = "import sys; print('torch' in sys.modules and 'fastapi' in sys.modules)"


def test_a_command_is_forked_with_torch_already_imported() -> None:
    proc = run_python(["-c", PREIMPORTED])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "True\n"


# HF_HOME: read by huggingface_hub while transformers (preloaded) imports.
@pytest.mark.parametrize("variable", ["OMP_NUM_THREADS", "PYTHONHASHSEED", "LD_PRELOAD", "HF_HOME"])
def test_a_changed_start_up_variable_gets_an_ordinary_start(variable: str) -> None:
    value = "" if variable == "LD_PRELOAD" else "3"
    proc = run_python(["-c", PREIMPORTED], {variable: value})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "False\n"


def test_disabled_by_its_variable() -> None:
    proc = run_python(["-c", PREIMPORTED], {forkserver.DISABLE_ENV: "0"})
    assert proc.stdout == "False\n"


def test_arguments_environment_directory_and_streams(tmp_path: Path) -> None:
    code = (
        "import os, sys; print(sys.argv, os.environ['KILN_FS_TEST'], os.getcwd()); "
        "print('to stderr', file=sys.stderr); print(repr(sys.stdin.read()))"
    )
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        proc = run_python(["-c", code, "a", "b c"], {"KILN_FS_TEST": "value"})
    finally:
        os.chdir(cwd)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"['-c', 'a', 'b c'] value {tmp_path}\n''\n"
    assert proc.stderr == "to stderr\n"
    # Nothing of the server's environment (this process's) that the command's lacks leaks in.
    env = {k: v for k, v in os.environ.items() if k != "HOME"}
    with tempfile.TemporaryFile() as out:
        proc = forkserver.popen(["-c", "import os; print('HOME' in os.environ)"], env, out, out)
        assert isinstance(proc, forkserver.ForkedProcess)
        assert proc.wait(60) == 0
        out.seek(0)
        assert out.read() == b"False\n"


@pytest.mark.parametrize(
    ("code", "status", "stderr"),
    [
        ("raise SystemExit(7)", 7, ""),
        ("raise SystemExit('a message')", 1, "a message\n"),
        ("import sys; sys.exit()", 0, ""),
        ("raise ValueError('broken')", 1, "ValueError: broken\n"),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -signal.SIGKILL, ""),
    ],
)
def test_exit_status_is_the_interpreters(code: str, status: int, stderr: str) -> None:
    proc = run_python(["-c", code])
    assert proc.returncode == status
    assert proc.stderr.endswith(stderr)


def test_atexit_handlers_and_threads_finish_before_it_exits() -> None:
    code = (
        "import atexit, threading, time; atexit.register(print, 'atexit'); "
        "threading.Thread(target=lambda: (time.sleep(0.5), print('thread'))).start()"
    )
    assert run_python(["-c", code]).stdout == "thread\natexit\n"


def test_a_module_and_a_script_run_as_main(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(
        "import multiprocessing, sys\n"
        "def square(x):\n    return x * x\n"
        "if __name__ == '__main__':\n"
        "    with multiprocessing.get_context('spawn').Pool(1) as pool:\n"
        "        print(sys.argv[1:], sys.path[0], pool.map(square, [3]))\n"
    )
    proc = run_python([str(script), "x"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"['x'] {tmp_path} [9]\n"
    proc = run_python(["-m", "json.tool", "--compact", str(tmp_path / "missing.json")])
    assert proc.returncode != 0
    assert "missing.json" in proc.stderr


def test_a_command_past_its_timeout_is_killed() -> None:
    with tempfile.NamedTemporaryFile("w+") as pid_file:
        code = f"import os, time; open({pid_file.name!r}, 'w').write(str(os.getpid())); "
        code += "time.sleep(60)"
        with pytest.raises(subprocess.TimeoutExpired):
            run_python(["-c", code], timeout=3)
        pid = int(Path(pid_file.name).read_text())
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{pid}"), "the timed-out command still runs"


def test_popen_in_a_new_session_can_be_signalled() -> None:
    with tempfile.TemporaryFile() as out:
        code = "import os, time; print(os.getsid(0) == os.getpid(), flush=True); time.sleep(60)"
        proc = forkserver.popen(["-c", code], dict(os.environ), out, out, new_session=True)
        assert isinstance(proc, forkserver.ForkedProcess)
        assert proc.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(0.5)
        deadline = time.monotonic() + 30
        while out.tell() == 0 and os.fstat(out.fileno()).st_size == 0:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        proc.terminate()
        assert proc.wait(10) == -signal.SIGTERM
        out.seek(0)
        assert out.read() == b"True\n"


def test_the_server_is_this_processs_own() -> None:
    """A forked pytest (xdist) worker must not share its parent's server."""
    code = (
        "import os, sys\n"
        "from kiln.testing import run_python\n"
        "assert run_python(['-c', 'print(1)']).stdout == '1\\n'\n"
        "if os.fork() == 0:\n"
        "    os._exit(0 if run_python(['-c', 'print(2)']).stdout == '2\\n' else 3)\n"
        "print(os.waitstatus_to_exitcode(os.wait()[1]))\n"
        "from kiln.testing.forkserver import FORK_SERVER\n"
        "print(os.path.dirname(FORK_SERVER._address))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    status, directory = proc.stdout.splitlines()
    assert status == "0"
    # Its server exits with it and removes its socket's directory.
    deadline = time.monotonic() + 10
    while os.path.exists(directory) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(directory)
