"""Discovery, platform selection, the allowlist, and introspection, through real entry points.

Each case runs ``kiln plugins --json`` in a fresh process with the test plugin installed; the
``KILN_TEST_*`` variables switch its behaviours on (see ``kiln_test_plugin/__init__.py``).
Cases that ask for the same command in the same environment share one run of it.
"""

import copy
import functools
import os
from typing import Any

import pytest

from kiln import testing
from kiln.testing import run_python

pytestmark = pytest.mark.plugin


@functools.cache
def _report_of(
    platform: str | None, environment: frozenset[tuple[str, str]], plugin_config: str | None
) -> tuple[int, dict[str, Any]]:
    return testing.plugin_report(platform, dict(environment), plugin_config)


def plugin_report(
    platform: str | None = None,
    env: dict[str, str] | None = None,
    plugin_config: str | None = None,
) -> tuple[int, dict[str, Any]]:
    """``kiln.testing.plugin_report``, run once per distinct command and whole environment."""
    environment = frozenset({**os.environ, **(env or {})}.items())
    rc, report = _report_of(platform, environment, plugin_config)
    return rc, copy.deepcopy(report)


def _record(report, name, group="platform_plugins"):
    return next(r for r in report[group] if r["name"] == name)


def test_discovery_finds_every_entry_point_with_its_distribution():
    rc, report = plugin_report()
    assert rc == 0
    names = {r["name"]: r for r in report["platform_plugins"]}
    assert {"kiln_test", "kiln_test_b", "kiln_test_old", "kiln_test_broken", "cpu"} <= set(names)
    assert names["kiln_test"]["distribution"] == "kiln-test-plugin 0.1.0"
    assert names["kiln_test"]["value"] == "kiln_test_plugin:detect_test_platform"
    assert names["cpu"]["distribution"] == "kiln (built-in)"
    general = {r["name"]: r["status"] for r in report["general_plugins"]}
    assert general == {"kiln_test": "loaded", "kiln_test_failing": "loaded"}
    assert report["phases"] == ["discover", "select", "register", "configure", "init-process"]


def test_builtin_cpu_when_no_out_of_tree_platform_activates():
    rc, report = plugin_report()
    assert rc == 0
    assert report["platform"]["name"] == "cpu"
    assert "built-in" in report["platform"]["reason"]
    assert _record(report, "kiln_test")["status"] == "inactive"


def test_one_active_out_of_tree_platform_wins_over_builtins():
    rc, report = plugin_report(env={"KILN_TEST_PLATFORM": "1"})
    assert rc == 0
    assert report["platform"]["name"] == "kiln_test"
    assert report["platform"]["class"] == "kiln_test_plugin.platform.TestPlatform"
    assert _record(report, "cpu")["status"] == "active"  # active, but not chosen


def test_two_active_out_of_tree_platforms_is_an_error_naming_both():
    rc, report = plugin_report(env={"KILN_TEST_PLATFORM": "1", "KILN_TEST_PLATFORM_B": "1"})
    assert rc == 1
    assert "more than one platform plugin" in report["error"]
    assert "kiln_test (kiln-test-plugin" in report["error"]
    assert "kiln_test_b (kiln-test-plugin" in report["error"]
    assert report["platform"] is None


@pytest.mark.parametrize("how", ["flag", "env"])
def test_forced_platform_wins_and_other_detectors_do_not_run(how):
    env = {"KILN_TEST_PLATFORM": "1", "KILN_TEST_PLATFORM_B": "1"}
    if how == "env":
        env["KILN_PLATFORM"] = "cpu"
    rc, report = plugin_report(platform="cpu" if how == "flag" else None, env=env)
    assert rc == 0
    assert report["platform"]["name"] == "cpu"
    assert "forced" in report["platform"]["reason"]
    assert _record(report, "kiln_test")["status"] == "not-run"


def test_forcing_an_unknown_platform_lists_the_available_ones():
    rc, report = plugin_report(platform="tpu9000")
    assert rc == 1
    assert "'tpu9000'" in report["error"] and "'cpu'" in report["error"]


def test_forcing_a_platform_whose_detector_finds_nothing_is_an_error():
    rc, report = plugin_report(platform="kiln_test")
    assert rc == 1
    assert "found no device" in report["error"]


def test_a_detector_that_raises_is_reported_with_its_traceback():
    rc, report = plugin_report(env={"KILN_TEST_BROKEN_DETECTOR": "1"})
    assert rc == 0
    broken = _record(report, "kiln_test_broken")
    assert broken["status"] == "error"
    assert "RuntimeError: probe of the kiln_test_broken device failed" in broken["detail"]
    assert "Traceback" in broken["traceback"] and "detect_broken" in broken["traceback"]
    assert report["platform"]["name"] == "cpu"


def test_a_platform_built_for_another_api_major_is_refused_with_both_versions():
    rc, report = plugin_report(env={"KILN_TEST_OLD_API": "1"})
    assert rc == 1
    assert "platform API 0.9" in report["error"]
    assert "provides API 1.0" in report["error"]
    assert _record(report, "kiln_test_old")["status"] == "refused"


def test_allowlist_filters_general_plugins_but_never_the_platform():
    env = {"KILN_PLUGINS": "kiln_test_failing", "KILN_TEST_PLATFORM": "1"}
    rc, report = plugin_report(env=env)
    assert rc == 0
    assert report["platform"]["name"] == "kiln_test"
    assert _record(report, "kiln_test", "general_plugins")["status"] == "filtered"
    assert _record(report, "kiln_test_failing", "general_plugins")["status"] == "loaded"
    assert report["plugin_registrations"] == []  # kiln_test registered nothing


def test_empty_allowlist_loads_no_general_plugin():
    rc, report = plugin_report(env={"KILN_PLUGINS": ""})
    assert rc == 0
    assert {r["status"] for r in report["general_plugins"]} == {"filtered"}


def test_a_failing_general_plugin_is_reported_and_the_others_still_load():
    rc, report = plugin_report(env={"KILN_TEST_FAIL_REGISTER": "1"})
    assert rc == 0
    failing = _record(report, "kiln_test_failing", "general_plugins")
    assert failing["status"] == "failed"
    assert "could not register" in failing["detail"]
    assert _record(report, "kiln_test", "general_plugins")["status"] == "loaded"


def test_config_fields_the_platform_changed_are_listed():
    rc, report = plugin_report(env={"KILN_TEST_PLATFORM": "1"})
    assert rc == 0
    changes = {c["field"]: (c["old"], c["new"]) for c in report["config_changes"]}
    assert changes["scheduler.max_num_seqs"] == (64, 8)
    assert changes["device.worker_cls"] == ("auto", "kiln_test_plugin.classes.TestWorker")
    assert changes["model.dtype"] == ("auto", "float32")
    assert "cache.block_size" not in changes


def test_plugin_registrations_and_op_implementations_are_listed():
    rc, report = plugin_report()
    assert rc == 0
    registered = {(r["registry"], r["name"]): r["plugin"] for r in report["plugin_registrations"]}
    assert registered[("model", "KilnTestForCausalLM")] == "kiln_test"
    assert registered[("op", "kiln_test_scale")] == "kiln_test"
    impls = [(i["provider"], i["priority"]) for i in report["op_implementations"]]
    assert ("kiln_test_fast", 10) in impls and ("kiln_test_generic", 1) in impls


@pytest.mark.parametrize(
    ("kind", "needle"),
    [("missing", "lacks method 'barrier'"), ("signature", "requires parameter 'group'")],
)
def test_classes_that_do_not_implement_their_interface_are_named(kind, needle):
    rc, report = plugin_report(env={"KILN_TEST_PLATFORM": "1", "KILN_TEST_BAD_CLASS": kind})
    classes = {c["field"]: c["status"] for c in report["classes"]}
    assert needle in classes["communicator_cls"]
    assert "InterfaceError" in classes["communicator_cls"]
    assert classes["worker_cls"] == "ok"


@pytest.mark.parametrize(
    ("kind", "status", "detail"),
    [
        ("good", "applied", ""),
        ("drift", "refused", "target source changed"),
        ("warn", "applied-with-warning", "target source changed"),
        ("missing", "refused", "is missing"),
    ],
)
def test_patches_are_applied_or_refused_and_reported(kind, status, detail):
    rc, report = plugin_report(env={"KILN_TEST_PATCH": kind})
    assert rc == 0
    (patch,) = report["patches"]
    assert patch["status"] == status
    assert detail in patch["detail"]
    assert patch["plugin"] == "kiln_test"
    assert patch["scope"] == "platform"


def test_valid_plugin_config_is_accepted():
    rc, report = plugin_report(plugin_config='{"kiln_test": {"scale": 3, "mode": "generic"}}')
    assert rc == 0, report.get("error")
    fields = {row["field"]: row for row in report["plugin_config"]["kiln_test"]}
    assert fields["mode"]["type"] == "Literal['fast', 'generic']"


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('{"kiln_test": {"speed": 1}}', "kiln_test.speed is not a known key"),
        ('{"kiln_test": {"scale": "big"}}', "kiln_test.scale='big' is invalid; allowed: float"),
        ('{"kiln_test": {"mode": "turbo"}}', "allowed: Literal['fast', 'generic']"),
        ('{"nope": {}}', "unknown plugin section(s) ['nope']"),
        ("{not json", "not valid JSON"),
    ],
)
def test_invalid_plugin_config_is_rejected_with_the_field_named(text, needle):
    rc, report = plugin_report(plugin_config=text)
    assert rc == 1
    assert needle in report["error"]


def test_human_readable_output_shows_platform_and_changes():
    proc = run_python(["-m", "kiln.entrypoints.cli", "plugins"], {"KILN_TEST_PLATFORM": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "Platform: kiln_test (kiln_test_plugin.platform.TestPlatform, API 1.0)" in proc.stdout
    assert "scheduler.max_num_seqs" in proc.stdout
    assert "kiln_test_fast" in proc.stdout


def test_a_plugin_model_that_breaks_the_model_contract_fails_kiln_plugins():
    env = {"KILN_TEST_PLATFORM": "1"}
    assert run_python(["-m", "kiln.entrypoints.cli", "plugins"], env).returncode == 0
    proc = run_python(
        ["-m", "kiln.entrypoints.cli", "plugins"], {**env, "KILN_TEST_BAD_MODEL": "1"}
    )
    assert proc.returncode == 1, proc.stdout
    assert (
        "model KilnTestBadForCausalLM = kiln_test_plugin.classes.MisspeltModel (registered by "
        "'kiln_test'): lacks the model contract's compute_logits" in proc.stdout
    )


def test_loading_is_idempotent_in_a_fresh_process():
    code = (
        "import kiln_test_plugin, json\n"
        "from kiln.config import KilnConfig\n"
        "from kiln.plugins import init_process\n"
        "from kiln.plugins.manager import get_plugin_manager\n"
        "c1 = init_process('engine', KilnConfig())\n"
        "c2 = init_process('engine', KilnConfig())\n"
        "get_plugin_manager().load_general_plugins()\n"
        "print(json.dumps({'calls': len(kiln_test_plugin.REGISTER_CALLS), 'same': c1 == c2,\n"
        "                  'phases': get_plugin_manager().phases}))\n"
    )
    proc = run_python(["-c", code], {"KILN_TEST_PATCH": "good"})
    assert proc.returncode == 0, proc.stderr
    import json

    result = json.loads(proc.stdout)
    assert result == {
        "calls": 1,
        "same": True,
        "phases": ["discover", "select", "register", "configure", "init-process"],
    }


def test_the_chosen_platform_declares_its_own_config_section():
    rc, report = plugin_report(plugin_config='{"cpu": {"num_threads": 1}}')
    assert rc == 0, report.get("error")
    assert [row["field"] for row in report["plugin_config"]["cpu"]] == ["num_threads"]
    rc, report = plugin_report(plugin_config='{"cpu": {"num_threads": 0}}')
    assert rc == 1
    assert "cpu.num_threads=0 is invalid" in report["error"]


def test_the_platform_registers_its_op_implementations_under_its_name():
    from kiln.platforms.cpu_ops import onednn_bf16_available

    if not onednn_bf16_available():
        pytest.skip("oneDNN has no bf16 on this CPU")
    rc, report = plugin_report()
    assert rc == 0
    impls = {(i["op"], i["provider"]): i["plugin"] for i in report["op_implementations"]}
    assert impls[("linear", "onednn")] == "cpu"
    assert impls[("logits_processor", "onednn")] == "cpu"
