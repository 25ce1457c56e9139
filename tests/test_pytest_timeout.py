"""Every test runs under a timeout (``pytest-timeout``, ``timeout`` in pyproject.toml's pytest
options), so a regression that loops forever fails the run instead of hanging CI."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_default_timeout_is_configured(pytestconfig: pytest.Config) -> None:
    assert pytestconfig.pluginmanager.hasplugin("timeout")
    assert float(pytestconfig.getini("timeout")) > 0


def test_an_endless_loop_fails_instead_of_hanging() -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "test_endless.py")
        with open(path, "w") as f:
            f.write("def test_endless():\n    while True:\n        pass\n")
        # The project's options (rootdir = the checkout), with the limit shortened to 2 s.
        command = [sys.executable, "-m", "pytest", path, "-q", "-p", "no:cacheprovider"]
        command += ["--rootdir", ROOT, "-c", os.path.join(ROOT, "pyproject.toml")]
        command += ["-o", "timeout=2"]
        result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "Timeout" in output and "1 failed" in output, output
