"""The conformance suite a platform plugin runs against itself (see ``kiln.testing``).

Import its tests into a test module and define two module-scoped fixtures: ``kiln_platform`` (the
platform's name) and ``kiln_platform_env`` (environment variables that make its detector activate).
By default they come from ``KILN_CONFORMANCE_PLATFORM`` and nothing.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from kiln.testing import plugin_report, run_check

__all__ = [
    "kiln_platform",
    "kiln_platform_env",
    "kiln_plugin_report",
    "test_platform_loads_in_fresh_process",
    "test_general_plugins_load",
    "test_named_classes_implement_interfaces",
    "test_registration_is_idempotent",
    "test_op_implementations_match_native",
    "test_greedy_tokens_match_the_reference_platform",
]


@pytest.fixture(scope="module")
def kiln_platform() -> str:
    return os.environ.get("KILN_CONFORMANCE_PLATFORM", "cpu")


@pytest.fixture(scope="module")
def kiln_platform_env() -> dict[str, str]:
    return {}


@pytest.fixture(scope="module")
def kiln_plugin_report(kiln_platform: str, kiln_platform_env: dict[str, str]) -> dict[str, Any]:
    rc, report = plugin_report(kiln_platform, kiln_platform_env)
    assert rc == 0, f"`kiln plugins --platform {kiln_platform}` failed: {report.get('error')}"
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
    """Every class the platform names resolves and matches its interface."""
    bad = [c for c in kiln_plugin_report["classes"] if c["status"] != "ok"]
    assert not bad, "\n".join(f"{c['field']} = {c['class']}: {c['status']}" for c in bad)


def test_registration_is_idempotent(kiln_platform: str, kiln_platform_env: dict) -> None:
    """Running every general plugin's register() again changes no registry and raises nothing."""
    result = run_check("idempotence", kiln_platform, kiln_platform_env)
    assert not result["errors"], "\n".join(result["errors"])
    assert result["equal"], f"registries changed:\n{result['before']}\n{result['after']}"


def test_op_implementations_match_native(kiln_platform: str, kiln_platform_env: dict) -> None:
    """Each op implementation for the platform's device matches forward_native on the op's
    examples."""
    result = run_check("ops", kiln_platform, kiln_platform_env)
    bad = [r for r in result["results"] if r["status"] in ("mismatch", "unknown-op")]
    assert not bad, "\n".join(f"{r['op']}[{r['provider']}]: {r['detail']}" for r in bad)


def test_greedy_tokens_match_the_reference_platform(
    kiln_platform: str, kiln_platform_env: dict
) -> None:
    """The default model, float32, greedy: the same tokens as on Kiln's reference cpu platform."""
    got = run_check("greedy", kiln_platform, kiln_platform_env)
    want = run_check("greedy", "cpu")
    for text, tokens, ref_tokens in zip(got["texts"], got["tokens"], want["tokens"], strict=True):
        assert tokens == ref_tokens, f"{kiln_platform} generated {text!r}"
