"""Kiln's conformance kit for plugin authors, and helpers for tests that need a fresh process.

A platform plugin runs the kit from its own test suite::

    # tests/test_kiln_conformance.py
    import pytest
    from kiln.testing.conformance import *  # noqa: F403  (collects the kit's tests)

    @pytest.fixture(scope="module")
    def kiln_platform():
        return "my_platform"   # the kiln.platform_plugins entry-point name (== Platform.name)

    @pytest.fixture(scope="module")
    def kiln_platform_env():
        return {"MY_DEVICE_VISIBLE": "0"}   # whatever makes its detector activate

    # Only for kernels that are not bit-exact by design (quantized, reduced precision):
    # @pytest.fixture(scope="module")
    # def kiln_logits_tolerance():
    #     return LogitsTolerance(min_top1_agreement=0.98, max_logprob_diff=0.2)

Every check runs in a fresh Python process, the way Kiln's engine processes start: entry points
load and the platform is selected there, not in the pytest process. The process is forked from
one that has imported torch and nothing of Kiln (``kiln.testing.forkserver``), unless the check's
environment changes what interpreter start or ``import torch`` reads.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

from kiln.testing import forkserver


def run_python(
    args: list[str], env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """Run ``python ARGS`` in a fresh process with ``env`` added to this one's environment:
    forked from a process that has imported torch and nothing of Kiln when that changes nothing
    the command could see (``kiln.testing.forkserver``), else started the ordinary way.

    Raises:
        subprocess.TimeoutExpired: it ran past ``timeout`` seconds (it is killed).
    """
    full_env = {**os.environ, **(env or {})}
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = forkserver.popen(args, full_env, out, err)
        try:
            returncode = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(
            [sys.executable, *args],
            returncode,
            out.read().decode(errors="replace"),
            err.read().decode(errors="replace"),
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


def run_check(
    name: str, platform: str, env: dict[str, str] | None = None, *args: str
) -> dict[str, Any]:
    """Run one of ``kiln.testing.checks`` in a fresh process and return its JSON result.

    Up to 600 s: a platform may build its kernels on first use, on a busy 2-core CI machine."""
    proc = run_python(["-m", "kiln.testing.checks", name, platform, *args], env, timeout=600)
    if proc.returncode != 0:
        raise AssertionError(f"check {name!r} crashed (rc={proc.returncode}):\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@functools.cache
def reference_greedy() -> dict[str, Any]:
    """The greedy check on Kiln's reference cpu platform (run once per test process)."""
    return run_check("greedy", "cpu")


@dataclass(frozen=True)
class LogitsTolerance:
    """How far a platform whose kernels are not bit-exact (quantized, reduced precision) may be
    from the reference, measured teacher-forced: both platforms score the same token sequences
    (each prompt followed by the reference's greedy completion), so one early difference does not
    derail the rest."""

    min_top1_agreement: float = 0.99
    """Least share of positions where the platform's most likely token is the reference's."""
    max_logprob_diff: float = 0.1
    """Largest absolute difference, at any position, of the forced token's log-probability."""


def logits_agreement(got: dict[str, Any], want: dict[str, Any]) -> tuple[float, float]:
    """``(top-1 agreement, max logprob difference)`` of two greedy-check results' teacher-forced
    positions."""
    positions = agreeing = 0
    max_diff = 0.0
    for got_rows, want_rows in zip(got["teacher_forced"], want["teacher_forced"], strict=True):
        for (got_top, got_lp), (want_top, want_lp) in zip(got_rows, want_rows, strict=True):
            positions += 1
            agreeing += got_top == want_top
            max_diff = max(max_diff, abs(got_lp - want_lp))
    return agreeing / max(positions, 1), max_diff


def compare_greedy(
    got: dict[str, Any], want: dict[str, Any], tolerance: LogitsTolerance | None = None
) -> str | None:
    """None when the platform's greedy-check result ``got`` conforms to the reference's ``want``,
    else what differs: exactly equal tokens without ``tolerance``; the teacher-forced agreement
    and logprob difference within ``tolerance`` with it. The message gives both measures."""
    from kiln.testing.checks import GREEDY_BUDGET, GREEDY_PROMPTS

    platform = got["platform"]
    agreement, max_diff = logits_agreement(got, want)
    measured = (
        f"measured teacher-forced: top-1 agreement {agreement:.4f}, "
        f"max logprob difference {max_diff:.3g}"
    )
    if not any(got["cached_tokens"]):
        return (
            f"no prompt hit the prefix cache on {platform} (cached tokens {got['cached_tokens']}); "
            "the check needs prefix caching on"
        )
    if tolerance is None:
        pairs = zip(got["tokens"], want["tokens"], strict=True)
        for index, (tokens, ref_tokens) in enumerate(pairs):
            if tokens == ref_tokens:
                continue
            at = next(k for k, (a, b) in enumerate(zip(tokens, ref_tokens, strict=True)) if a != b)
            return (
                f"prompt {index} ({GREEDY_PROMPTS[index][-40:]!r}: {got['prompt_lens'][index]} "
                f"tokens, {got['cached_tokens'][index]} from the prefix cache, prefilled in "
                f"chunks of at most {GREEDY_BUDGET}): greedy token {at} differs from the "
                f"reference cpu platform's; {platform} generated {got['texts'][index]!r}, the "
                f"reference {want['texts'][index]!r}; {measured}. Kernels that are not "
                "bit-exact by design (quantized, reduced precision) set the kit's "
                "kiln_logits_tolerance fixture to a LogitsTolerance instead"
            )
        return None
    problems = []
    if agreement < tolerance.min_top1_agreement:
        problems.append(
            f"top-1 agreement {agreement:.4f} < min_top1_agreement {tolerance.min_top1_agreement}"
        )
    if max_diff > tolerance.max_logprob_diff:
        problems.append(
            f"max logprob difference {max_diff:.3g} > max_logprob_diff {tolerance.max_logprob_diff}"
        )
    if not problems:
        return None
    return f"{platform} against the reference cpu platform, teacher-forced: " + "; ".join(problems)


def compare_connector_run(
    got: dict[str, Any], want: dict[str, Any], tolerance: LogitsTolerance | None = None
) -> str | None:
    """None when the ``kv_connector`` check's run with the connector (``got``) gives what the
    run without one (``want``) gave, else what differs: the connector must have supplied tokens,
    and the tokens must be equal, their log-probabilities within 1e-4 (without ``tolerance``);
    with ``tolerance``, log-probabilities within its ``max_logprob_diff`` up to the first token
    that differs."""
    hit_tokens = got["connector_stats"].get("hit_tokens", 0)
    if not hit_tokens or got["cached_tokens"][2] <= want["cached_tokens"][2]:
        return (
            f"the connector supplied no token of the prompt that came back (cached tokens "
            f"{got['cached_tokens']} with it, {want['cached_tokens']} without; its counters "
            f"{got['connector_stats']})"
        )
    limit = 1e-4 if tolerance is None else tolerance.max_logprob_diff
    for index, (tokens, ref_tokens) in enumerate(zip(got["tokens"], want["tokens"], strict=True)):
        if tolerance is None and tokens != ref_tokens:
            return f"prompt {index}: tokens {tokens} with the connector, {ref_tokens} without"
        pairs = zip(
            tokens, ref_tokens, got["logprobs"][index], want["logprobs"][index], strict=True
        )
        for position, (token, ref_token, logprob, ref_logprob) in enumerate(pairs):
            if token != ref_token:
                break
            if abs(logprob - ref_logprob) > limit:
                return (
                    f"prompt {index}, token {position}: logprob {logprob} with the connector, "
                    f"{ref_logprob} without (more than {limit} apart)"
                )
    return None
