"""The bugs a plugin author hit (issue 11, section 1), each through the path the author takes:
``kiln plugins`` or ``LLM`` in a fresh process with the test plugin's platform."""

import pytest

from kiln.model_executor.custom_op import OpRegistry
from kiln.testing import plugin_report, run_python

pytestmark = pytest.mark.plugin


def test_an_attention_backend_that_does_not_subclass_the_interface_is_not_ok():
    # The core refuses it when it builds the model; kiln plugins must not say "ok" first.
    rc, report = plugin_report(env={"KILN_TEST_PLATFORM": "1", "KILN_TEST_BAD_CLASS": "attention"})
    classes = {c["field"]: c["status"] for c in report["classes"]}
    assert "must subclass AttentionBackend" in classes["attention_backend"]
    assert rc == 1


@pytest.mark.parametrize(
    ("kind", "field", "needle"),
    [
        ("missing", "communicator_cls", "lacks method 'barrier'"),
        ("attention", "attention_backend", "must subclass AttentionBackend"),
    ],
)
def test_kiln_plugins_exits_non_zero_naming_the_field_and_the_platform(kind, field, needle):
    rc, report = plugin_report(env={"KILN_TEST_PLATFORM": "1", "KILN_TEST_BAD_CLASS": kind})
    assert rc == 1
    assert f"device.{field} = kiln_test_plugin.classes." in report["error"]
    assert "set by platform 'kiln_test'" in report["error"]
    assert needle in report["error"]


def test_a_dotted_path_that_does_not_resolve_exits_non_zero():
    rc, report = plugin_report(
        env={"KILN_TEST_PLATFORM": "1", "KILN_TEST_BAD_CLASS": "unresolvable"}
    )
    assert rc == 1
    assert (
        "device.communicator_cls = kiln_test_plugin.classes.NoSuchCommunicator" in (report["error"])
    )


def test_a_platform_named_otherwise_than_its_entry_point_is_refused_naming_both():
    rc, report = plugin_report(env={"KILN_TEST_PLATFORM": "misnamed"})
    assert rc == 1
    assert "PlatformSelectionError" in report["error"]
    assert "MisnamedPlatform.name is 'kiln_test_device'" in report["error"]
    assert "entry point is named 'kiln_test'" in report["error"]
    record = next(r for r in report["platform_plugins"] if r["name"] == "kiln_test")
    assert record["status"] == "refused"


def test_forcing_a_platform_by_a_name_that_is_no_entry_point_says_which_names_count():
    rc, report = plugin_report("kiln_test_device", env={"KILN_TEST_PLATFORM": "misnamed"})
    assert rc == 1
    assert (
        "'kiln_test_device' (from --platform / KILN_PLATFORM) is not installed" in (report["error"])
    )
    assert "names of the kiln.platform_plugins entry points" in report["error"]


GENERATE_TWO_TOKENS = """
from kiln import LLM, SamplingParams
llm = LLM(platform="kiln_test", dtype="float32", kv_cache_memory=0.05, max_model_len=64)
out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
print(len(out[0].outputs[0].token_ids))
"""


def test_a_model_runner_with_exactly_the_interface_serves_through_the_reference_worker():
    # The reference Worker once read runner members outside ModelRunnerBase (max_model_len,
    # dummy_run): a runner that implemented just the interface passed every check, then crashed.
    env = {"KILN_TEST_PLATFORM": "1", "KILN_TEST_RUNNER": "interface-only"}
    rc, report = plugin_report(env=env)
    assert rc == 0, report.get("error")
    assert {c["field"]: c["status"] for c in report["classes"]}["model_runner_cls"] == "ok"
    proc = run_python(["-c", GENERATE_TWO_TOKENS], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-1] == "2"


def test_op_implementations_are_reported_when_the_plugin_config_is_invalid():
    # The report is needed most when configuration fails; Kiln's ops must be known without a
    # model having been built in the process.
    rc, report = plugin_report(plugin_config='{"no_such_section": {}}')
    assert rc == 1 and "no_such_section" in report["error"]
    impls = {(i["op"], i["provider"]) for i in report["op_implementations"]}
    assert ("linear", "onednn") in impls, impls  # the cpu platform's own implementation


def _plugin_register(registry, scale, factor=2.0):
    def scaled(op, x):
        return x * factor

    # docs/platforms.md's pattern: a lambda predicate written inside register().
    registry.register_impl(
        "my_op", "my_kernels", device_type="npu", priority=10, supports=lambda op, x: x.ndim == 2
    )(_impl)
    registry.register_impl(
        "my_op", "captures", device_type="npu", supports=lambda op, x: x.shape[0] == scale
    )(_impl)
    # An implementation defined inside register() (issue 25): a new function each run.
    registry.register_impl("my_op", "nested", device_type="npu", priority=-1)(scaled)


def _impl(op, x):
    return x


def test_a_lambda_predicate_and_a_nested_implementation_register_again_without_error():
    registry = OpRegistry()
    _plugin_register(registry, 2)
    generation = registry.generation
    _plugin_register(registry, 2)
    assert registry.generation == generation
    assert len(registry.implementations("my_op")) == 3
    # A predicate or an implementation that captured another value is another registration:
    # refused as before.
    with pytest.raises(ValueError, match="already has an implementation from provider 'captures'"):
        _plugin_register(registry, 3)
    with pytest.raises(ValueError, match="already has an implementation from provider 'nested'"):
        _plugin_register(registry, 2, factor=3.0)


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"KILN_TEST_OLD_API": "1"}, "was written for platform API 0.9"),
        ({"KILN_TEST_PLATFORM": "misnamed"}, "entry point is named 'kiln_test'"),
    ],
)
def test_kiln_serve_refuses_a_platform_in_one_line_without_a_traceback(env, needle):
    # The platform is refused before the model is loaded or a port is bound.
    proc = run_python(["-m", "kiln.entrypoints.cli", "serve", "--port", "0"], env, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("kiln serve: ")]
    assert len(lines) == 1 and needle in lines[0], proc.stderr[-2000:]


START_LLM = """
from kiln import LLM
LLM(platform="kiln_test", dtype="float32", kv_cache_memory=0.05, max_model_len=64)
"""


def test_the_engine_checks_every_named_class_at_start_up():
    # The communicator is not used on one device; a platform naming a broken one must still
    # hear about it when the engine starts, not when tensor parallelism first calls it.
    env = {"KILN_TEST_PLATFORM": "1", "KILN_TEST_BAD_CLASS": "missing"}
    proc = run_python(["-c", START_LLM], env)
    assert proc.returncode != 0
    assert "InterfaceError: device.communicator_cls = kiln_test_plugin.classes." in proc.stderr
    assert "lacks method 'barrier'" in proc.stderr
