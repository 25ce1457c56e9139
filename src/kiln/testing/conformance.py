"""The conformance suite a platform plugin runs against itself (see ``kiln.testing``).

Import its tests into a test module and define module-scoped fixtures: ``kiln_platform`` (the
platform's name: its ``kiln.platform_plugins`` entry-point name, which equals ``Platform.name``),
``kiln_platform_env`` (environment variables that make its detector activate) and, only for
kernels that are not bit-exact by design, ``kiln_logits_tolerance`` (a ``LogitsTolerance``). By
default they come from ``KILN_CONFORMANCE_PLATFORM``, nothing and None (exact greedy tokens).

What each test checks, every one in a fresh process: the platform loads and is chosen; no general
plugin fails; every named class resolves and passes the check the core applies; running every
general plugin's ``register()`` again changes no registry (Kiln's own ops included) and raises
nothing; each op implementation for the platform's device type matches ``forward_native`` on the
op's examples; and the default model (float32) generates the reference cpu platform's greedy
tokens with a token budget of 16 (chunked prefill mixed with decodes) and prompts that share a
prefix (prefix-cache hits); the scheduler keeps its token budget and finishes every request
against a fake runner; the communicator's collectives give the documented results in three
processes (``kiln.testing.contracts``); a prefix that left the paged cache and comes back
through Kiln's offloading connector gives the tokens recomputing it gives. Kiln's own test suite
runs each check against a deliberately broken plugin and sees it fail. Its cost: about four
model loads and a few hundred tokens per platform, and four short processes without a model.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from kiln.testing import (
    LogitsTolerance,
    compare_connector_run,
    compare_greedy,
    plugin_report,
    reference_greedy,
    run_check,
)

__all__ = [
    "kiln_platform",
    "kiln_platform_env",
    "kiln_logits_tolerance",
    "kiln_plugin_report",
    "test_platform_loads_in_fresh_process",
    "test_general_plugins_load",
    "test_named_classes_implement_interfaces",
    "test_registration_is_idempotent",
    "test_op_implementations_match_native",
    "test_greedy_tokens_match_the_reference_platform",
    "test_scheduler_keeps_its_contract",
    "test_communicator_keeps_its_contract",
    "test_kv_connector_loads_what_recomputing_gives",
]


@pytest.fixture(scope="module")
def kiln_platform() -> str:
    return os.environ.get("KILN_CONFORMANCE_PLATFORM", "cpu")


@pytest.fixture(scope="module")
def kiln_platform_env() -> dict[str, str]:
    return {}


@pytest.fixture(scope="module")
def kiln_logits_tolerance() -> LogitsTolerance | None:
    """None: greedy tokens must equal the reference's exactly."""
    return None


@pytest.fixture(scope="module")
def kiln_plugin_report(kiln_platform: str, kiln_platform_env: dict[str, str]) -> dict[str, Any]:
    _rc, report = plugin_report(kiln_platform, kiln_platform_env)
    # A named class that fails its check is test_named_classes_implement_interfaces's to report.
    assert report.get("platform"), (
        f"`kiln plugins --platform {kiln_platform}` selected no platform: {report.get('error')}"
    )
    return report


def test_platform_loads_in_fresh_process(kiln_platform: str, kiln_plugin_report: dict) -> None:
    """The platform's entry point loads and its detector activates in a new process."""
    assert kiln_plugin_report["platform"]["name"] == kiln_platform
    record = next(r for r in kiln_plugin_report["platform_plugins"] if r["name"] == kiln_platform)
    assert record["status"] == "chosen", record


def test_general_plugins_load(kiln_plugin_report: dict) -> None:
    """No general plugin fails to register."""
    failed = [r for r in kiln_plugin_report["general_plugins"] if r["status"] == "failed"]
    assert not failed, "\n".join(f"{r['name']}: {r['traceback']}" for r in failed)


def test_named_classes_implement_interfaces(kiln_plugin_report: dict) -> None:
    """Every class the platform names resolves and passes the check the core applies to it."""
    bad = [c for c in kiln_plugin_report["classes"] if c["status"] != "ok"]
    assert not bad, "\n".join(f"device.{c['field']} = {c['class']}: {c['status']}" for c in bad)


def test_registration_is_idempotent(kiln_platform: str, kiln_platform_env: dict) -> None:
    """Running every general plugin's register() again changes no registry and raises nothing."""
    result = run_check("idempotence", kiln_platform, kiln_platform_env)
    assert not result["errors"], "register() raised when run again:\n" + "\n".join(result["errors"])
    changed = {
        key: {"before": result["before"][key], "after": result["after"][key]}
        for key in result["before"]
        if result["before"][key] != result["after"][key]
    }
    assert not changed, f"running register() again changed registries: {changed}"


def test_op_implementations_match_native(kiln_platform: str, kiln_platform_env: dict) -> None:
    """Each op implementation for the platform's device matches forward_native on the op's
    examples."""
    result = run_check("ops", kiln_platform, kiln_platform_env)
    bad = [r for r in result["results"] if r["status"] in ("mismatch", "unknown-op")]
    assert not bad, "\n".join(f"{r['op']}[{r['provider']}]: {r['detail']}" for r in bad)


def test_greedy_tokens_match_the_reference_platform(
    kiln_platform: str, kiln_platform_env: dict, kiln_logits_tolerance: LogitsTolerance | None
) -> None:
    """The default model, float32, greedy, under a token budget of 16 with prefix-cache hits:
    the reference cpu platform's tokens (or, with ``kiln_logits_tolerance``, its teacher-forced
    top-1 tokens and log-probabilities within the tolerance)."""
    want = reference_greedy()
    got = run_check("greedy", kiln_platform, kiln_platform_env, json.dumps(want["tokens"]))
    problem = compare_greedy(got, want, kiln_logits_tolerance)
    assert problem is None, problem


def test_scheduler_keeps_its_contract(kiln_platform: str, kiln_platform_env: dict) -> None:
    """The platform's scheduler, against a fake runner: every step within the config's
    ``max_num_batched_tokens`` and ``max_num_seqs``, requests scheduled contiguously, and each
    ending with its ``max_tokens`` sampled tokens."""
    result = run_check("scheduler", kiln_platform, kiln_platform_env)
    assert not result["problems"], f"{result['scheduler_cls']}: " + "\n".join(result["problems"])


def test_communicator_keeps_its_contract(kiln_platform: str, kiln_platform_env: dict) -> None:
    """The platform's communicator in three processes: ``all_reduce`` returns the sum,
    ``all_gather`` in rank order, ``broadcast``, ``send``/``recv``, and a ``ranks=`` sub-group
    the class makes itself (for a class that takes ``ranks``)."""
    result = run_check("communicator", kiln_platform, kiln_platform_env)
    assert not result["problems"], f"{result['communicator_cls']}: " + "\n".join(result["problems"])


def test_kv_connector_loads_what_recomputing_gives(
    kiln_platform: str, kiln_platform_env: dict, kiln_logits_tolerance: LogitsTolerance | None
) -> None:
    """The default model (float32, greedy) with the offloading connector: a prompt whose prefix
    left the paged cache loads it from the CPU tier (copies of the platform's KV-cache blocks
    along its backend's block dimension) and gets the tokens, and within 1e-4 (or
    ``kiln_logits_tolerance``) the log-probabilities, that the same run without a connector
    gets by recomputing."""
    result = run_check("kv_connector", kiln_platform, kiln_platform_env)
    problem = compare_connector_run(result["connector"], result["none"], kiln_logits_tolerance)
    assert problem is None, problem
