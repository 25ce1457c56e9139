"""Kiln's conformance kit for plugin authors, and helpers for tests that need a fresh process.

A platform plugin runs the kit from its own test suite::

    # tests/test_kiln_conformance.py
    import pytest
    from kiln.testing.conformance import *  # noqa: F403  (collects the kit's tests)

    @pytest.fixture(scope="module")
    def kiln_platform():
        return "my_device"

    @pytest.fixture(scope="module")
    def kiln_platform_env():
        return {"MY_DEVICE_VISIBLE": "0"}   # whatever makes its detector activate

Every check runs in a fresh Python process, the way Kiln's engine processes start: entry points
load and the platform is selected there, not in the pytest process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any


def run_python(
    args: list[str], env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """Run ``python ARGS`` in a fresh process with ``env`` added to this one's environment."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, *args],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def plugin_report(
    platform: str | None = None,
    env: dict[str, str] | None = None,
    plugin_config: str | None = None,
) -> tuple[int, dict[str, Any]]:
    """``(exit code, report)`` of ``kiln plugins --json`` run in a fresh process.

    Raises:
        AssertionError: the command printed no JSON (its stderr is in the message).
    """
    args = ["-m", "kiln.entrypoints.cli", "plugins", "--json"]
    if platform:
        args += ["--platform", platform]
    if plugin_config is not None:
        args += ["--plugin-config", plugin_config]
    proc = run_python(args, env)
    try:
        return proc.returncode, json.loads(proc.stdout)
    except json.JSONDecodeError:
        raise AssertionError(
            f"`kiln plugins --json` printed no JSON (rc={proc.returncode}):\n{proc.stderr}"
        ) from None


def run_check(name: str, platform: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one of ``kiln.testing.checks`` in a fresh process and return its JSON result."""
    proc = run_python(["-m", "kiln.testing.checks", name, platform], env)
    if proc.returncode != 0:
        raise AssertionError(f"check {name!r} crashed (rc={proc.returncode}):\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
