"""What a hardware team hit writing a platform from the docs alone (issue 25, item 8), each through
the path the team takes: the report of ``kiln plugins`` and ``GET /debug/plugins``, the op
registry, the graph buckets. (The scheduler and communicator contracts are checked by the kit:
``test_conformance_detects_problems.py``.)"""

from __future__ import annotations

import pytest

from kiln.config import KilnConfig, LoRAConfig, ParallelConfig
from kiln.model_executor.custom_op import OpRegistry
from kiln.platforms.cpu import CpuPlatform
from kiln.plugins.manager import PlatformChoice, PluginManager
from kiln.testing import plugin_report, run_python
from kiln.worker.graph import no_capture_reason

pytestmark = pytest.mark.plugin


def _configured_manager() -> PluginManager:
    manager = PluginManager(phases=["discover", "select", "register"])
    manager.choice = PlatformChoice("cpu", "kiln.platforms.cpu.CpuPlatform", "test", CpuPlatform)
    return manager


def test_the_engine_process_reports_the_config_changes_the_api_process_made():
    # kiln serve: the API process configures, then hands the updated config to the engine core,
    # whose own configure finds nothing left to change.
    api = _configured_manager()
    updated = api.configure(KilnConfig())
    engine = _configured_manager()
    engine.configure(updated)
    assert api.config_changes, "the cpu platform changes nothing?"
    assert engine.config_changes == api.config_changes
    fields = {name for name, _old, _new in engine.config_changes}
    assert {"device.worker_cls", "model.dtype"} <= fields


def test_builtin_registry_entries_are_kilns_whoever_imports_the_registry_first():
    # In the engine core nothing imports the registries before the general plugins run: the
    # first plugin whose register() imports one must not be credited with Kiln's entries.
    code = """
import json
from kiln.plugins.registry import registering_as
with registering_as("early_plugin"):
    from kiln.model_executor.registry import MODEL_REGISTRY
    from kiln.model_executor.loader import LOADER_REGISTRY
    from kiln.entrypoints.openai.tool_parsers import TOOL_PARSER_REGISTRY
    from kiln.reasoning import REASONING_PARSER_REGISTRY
    MODEL_REGISTRY.register("EarlyForCausalLM", "early.Model")
registries = (MODEL_REGISTRY, LOADER_REGISTRY, TOOL_PARSER_REGISTRY, REASONING_PARSER_REGISTRY)
print(json.dumps({r.kind: {n: r.source_of(n) for n in r.names()} for r in registries}))
"""
    proc = run_python(["-c", code])
    assert proc.returncode == 0, proc.stderr
    import json

    sources = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sources["model"]["LlamaForCausalLM"] == "kiln"
    assert sources["model"]["EarlyForCausalLM"] == "early_plugin"
    assert sources["loader"]["gguf"] == "kiln"
    assert sources["tool parser"]["hermes"] == "kiln"
    assert sources["reasoning parser"]["qwen3"] == "kiln"


def test_the_parsers_a_plugin_registered_are_listed():
    rc, report = plugin_report()
    assert rc == 0
    registered = {(r["registry"], r["name"]): r["plugin"] for r in report["plugin_registrations"]}
    assert registered[("tool parser", "kiln_test_plain")] == "kiln_test"
    assert registered[("reasoning parser", "kiln_test_reason")] == "kiln_test"
    # Kiln's own entries are not the plugin's.
    assert ("model", "LlamaForCausalLM") not in registered
    proc = run_python(["-m", "kiln.entrypoints.cli", "plugins"])
    assert "kiln_test_plain" in proc.stdout and "kiln_test_reason" in proc.stdout, proc.stdout


def test_another_function_with_the_same_code_is_another_implementation():
    registry = OpRegistry()

    def first(op, x):
        return x

    def second(op, x):
        return x

    registry.register_impl("my_op", "p", device_type="cpu")(first)
    with pytest.raises(ValueError, match="already has an implementation"):
        registry.register_impl("my_op", "p", device_type="cpu")(second)


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        (KilnConfig(parallel=ParallelConfig(tensor_parallel_size=2)), "tensor_parallel_size=2"),
        (KilnConfig(parallel=ParallelConfig(pipeline_parallel_size=2)), "pipeline_parallel_size=2"),
        (KilnConfig(lora=LoRAConfig(enable_lora=True)), "LoRA"),
    ],
)
def test_graphs_are_off_with_collectives_whatever_the_buckets(config, needle):
    assert needle in (no_capture_reason(config) or "")


def test_graphs_may_be_captured_on_one_rank():
    assert no_capture_reason(KilnConfig()) is None
