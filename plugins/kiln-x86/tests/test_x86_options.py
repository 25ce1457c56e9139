"""The ``x86`` config section: values checked on any machine (``X86Options``), values checked
against this machine's cores (``plan_binding``), and both as ``--plugin-config`` errors."""

import pytest
from kiln_x86.binding import BindingPlan, format_cpu_list, plan_binding
from kiln_x86.options import X86Options, parse_cpu_list

from kiln.testing import plugin_report, run_python

pytestmark = pytest.mark.plugin


def test_cpu_lists_parse_and_format():
    assert parse_cpu_list("0-3,8") == [0, 1, 2, 3, 8]
    assert parse_cpu_list(" 5 ,1-2,2") == [1, 2, 5]
    assert format_cpu_list([8, 0, 1, 2, 3]) == "0-3,8"
    assert format_cpu_list((4,)) == "4"
    for bad in ("", "a", "3-1", "1-", "-2", "0;1"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"num_threads": 0}, "x86.num_threads=0 is invalid; allowed: >= 1"),
        ({"reserved_cpus": -1}, "x86.reserved_cpus=-1 is invalid; allowed: >= 0"),
        ({"cpus": "0-x"}, "x86.cpus='0-x' is invalid"),
        ({"cpus": "0-1", "num_threads": 3}, "x86.num_threads=3 exceeds the 2 core(s)"),
        ({"num_prefill_threads": 0}, "x86.num_prefill_threads=0 is invalid; allowed: >= 1"),
        ({"min_prefill_tokens": 0}, "x86.min_prefill_tokens=0 is invalid; allowed: >= 1"),
        ({"cpus": "0", "num_prefill_threads": 2}, "x86.num_prefill_threads=2 exceeds the 1"),
        ({"int8_activations": "yes"}, "x86.int8_activations='yes' is invalid"),
        ({"helper_threads": -1}, "x86.helper_threads=-1 is invalid; allowed: >= 0"),
        ({"graph": "cuda"}, "x86.graph='cuda' is invalid; allowed: 'trace', 'inductor'"),
    ],
)
def test_invalid_values_name_the_field_and_what_is_allowed(values, message):
    with pytest.raises(ValueError) as err:
        X86Options(**values)
    assert message in str(err.value)


def test_defaults_on_two_cores_run_the_model_on_one_thread():
    # Below 4 cores nothing is reserved for the API server, and the model takes one thread
    # (docs/x86/threads.md has the measurements), prefill steps too, with a matmul helper on the
    # other core; asked for, it takes both, for every step (no core left for a helper) or for
    # prefill steps only (the pool then has both, pinned).
    assert plan_binding(X86Options(), "engine", [0, 1]) == BindingPlan(1, 1, (0,), (), (1,))
    assert plan_binding(X86Options(), "api", [0, 1]) == BindingPlan(1, 1, (0,), (), (1,))
    assert plan_binding(X86Options(), "offline", [0, 1]) == BindingPlan(1, 1, (0,), (), (1,))
    both = X86Options(num_threads=2)
    assert plan_binding(both, "engine", [0, 1]) == BindingPlan(2, 2, (0, 1), ())
    prefill = X86Options(num_prefill_threads=2)
    assert plan_binding(prefill, "engine", [0, 1]) == BindingPlan(1, 2, (0, 1), (), (1,))
    assert plan_binding(X86Options(), "engine", [0, 1, 2]).num_threads == 1


def test_larger_machines_keep_one_core_for_the_api_server():
    usable = [0, 1, 2, 3, 4, 5, 6, 7]
    plan = plan_binding(X86Options(), "engine", usable)
    assert plan == BindingPlan(7, 7, (1, 2, 3, 4, 5, 6, 7), (0,))
    # Offline there is no API server: every core runs the model.
    assert plan_binding(X86Options(), "offline", usable).model_cpus == tuple(usable)


def test_helper_threads_take_the_cores_the_model_threads_leave():
    helpers = X86Options(helper_threads=1)
    assert plan_binding(helpers, "engine", [0, 1]) == BindingPlan(1, 1, (0,), (), (1,))
    # More helpers than free cores: the rest run unpinned (-1); no pinning: all unpinned.
    assert plan_binding(X86Options(helper_threads=2), "offline", [0, 1]).helper_cpus == (1, -1)
    unpinned = X86Options(cpus="none", helper_threads=1)
    assert plan_binding(unpinned, "engine", [0, 1]).helper_cpus == (-1,)
    assert plan_binding(X86Options(helper_threads=0), "engine", [0, 1]).helper_cpus == ()
    # Default: the cores decode leaves on a small machine; none where the model takes them all.
    assert plan_binding(X86Options(), "engine", [0, 1, 2]).helper_cpus == (1, 2)
    assert plan_binding(X86Options(), "engine", list(range(8))).helper_cpus == ()


def test_explicit_cores_threads_and_no_pinning():
    usable = [0, 1, 2, 3]
    opts = X86Options(cpus="2-3", reserved_cpus=1)
    assert plan_binding(opts, "engine", usable) == BindingPlan(2, 2, (2, 3), (0,))
    one = plan_binding(X86Options(num_threads=1), "offline", usable)
    assert one == BindingPlan(1, 1, (0,), ())
    unpinned = plan_binding(X86Options(cpus="none", num_threads=6), "engine", usable)
    assert unpinned == BindingPlan(6, 6, None, (0,))


def test_cores_this_process_may_not_use_are_refused():
    expected = r"x86.cpus='2-5' names core\(s\) 4-5 .* allowed: cores 0-3"
    with pytest.raises(ValueError, match=expected):
        plan_binding(X86Options(cpus="2-5"), "offline", [0, 1, 2, 3])
    with pytest.raises(ValueError, match=r"x86.reserved_cpus=2 leaves no core for the model"):
        plan_binding(X86Options(reserved_cpus=2), "engine", [0, 1])
    with pytest.raises(ValueError, match=r"x86.num_threads=4 exceeds the 2 core\(s\)"):
        plan_binding(X86Options(num_threads=4), "offline", [0, 1])
    with pytest.raises(ValueError, match=r"x86.num_prefill_threads=3 exceeds the 2 core\(s\)"):
        plan_binding(X86Options(num_prefill_threads=3), "offline", [0, 1])


def test_plugin_config_errors_reach_kiln_plugins():
    rc, report = plugin_report(plugin_config='{"x86": {"num_threads": "two"}}')
    assert rc == 1
    expected = "--plugin-config x86.num_threads='two' is invalid; allowed: int | None"
    assert expected in report["error"]
    rc, report = plugin_report(plugin_config='{"x86": {"cpus": "0-4095"}}')
    assert rc == 1
    assert "x86.cpus='0-4095' names core(s)" in report["error"]
    rc, report = plugin_report(plugin_config='{"x86": {"num_threads": 1, "cpus": "none"}}')
    assert rc == 0, report.get("error")
    fields = [row["field"] for row in report["plugin_config"]["x86"]]
    assert fields == [
        "num_threads",
        "num_prefill_threads",
        "min_prefill_tokens",
        "cpus",
        "reserved_cpus",
        "int8_activations",
        "helper_threads",
        "graph",
    ]


CPU_SECTION_ALIAS = """
from kiln.config import KilnConfig, PluginConfig
from kiln.plugins import init_process
config = init_process("api", KilnConfig(plugins=PluginConfig(sections={SECTIONS})))
from kiln.platforms import current_platform  # what init_process selected
print(current_platform.name, current_platform.options(config).num_threads)
"""


@pytest.mark.parametrize(
    "sections, expected",
    [
        ({"cpu": {"num_threads": 1}}, "x86 1"),
        ({"cpu": {"num_threads": 1}, "x86": {"num_threads": 2, "cpus": "none"}}, "x86 2"),
    ],
)
def test_the_reference_platforms_thread_flag_still_works(sections, expected):
    # docs/models.md's `--plugin-config '{"cpu": {"num_threads": N}}'`; x86's own field wins when
    # given.
    proc = run_python(["-c", CPU_SECTION_ALIAS.replace("{SECTIONS}", repr(sections))])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == expected.split()


INT8_SWITCH = """
from kiln.config import KilnConfig, PluginConfig
from kiln.plugins import init_process
config = init_process("engine", KilnConfig(plugins=PluginConfig(sections={SECTIONS})))
from kiln.platforms import current_platform
print(current_platform.get_quant_config("gguf", config).method_cls.__name__)
"""
INT8 = "X86GGUFInt8ActivationsLinearMethod"


@pytest.mark.parametrize(
    "sections, expected",
    [
        ({}, INT8),
        ({"x86": {}}, INT8),
        ({"x86": {"int8_activations": True}}, INT8),
        ({"x86": {"int8_activations": False}}, "X86GGUFLinearMethod"),
    ],
)
def test_int8_activations_are_the_default(sections, expected):
    # On unless turned off: every row count runs the int8 kernels with the same result per row,
    # so a prefix-cached prompt's short prefill and the whole prompt agree.
    proc = run_python(["-c", INT8_SWITCH.replace("{SECTIONS}", repr(sections))])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[-1] == expected


def test_graph_mode_picks_the_wrapper_and_its_default_buckets():
    from kiln_x86.platform import COMPILED_WRAPPER, TRACE_SIZES, TRACED_WRAPPER, _graph_mode

    from kiln.config import KilnConfig

    base = KilnConfig()
    traced = _graph_mode(base, "trace").device
    assert traced.graph_wrapper_cls == TRACED_WRAPPER
    assert traced.graph_capture_sizes == TRACE_SIZES
    compiled = _graph_mode(base, "inductor").device
    assert (compiled.graph_wrapper_cls, compiled.graph_capture_sizes) == (COMPILED_WRAPPER, ())
    # Collectives and batch invariance: no buckets by default.
    for replaced in (
        {"parallel__tensor_parallel_size": 2},
        {"parallel__pipeline_parallel_size": 2},
        {"model__batch_invariant": True},
    ):
        assert _graph_mode(base.replace(**replaced), "trace").device.graph_capture_sizes == ()
    # Named buckets are kept (under tensor parallelism too: Kiln's runner then captures none).
    named = base.replace(device__graph_capture_sizes=(1, 4))
    assert _graph_mode(named, "trace").device.graph_capture_sizes == (1, 4)
    tp = named.replace(parallel__tensor_parallel_size=2)
    assert _graph_mode(tp, "trace").device.graph_capture_sizes == (1, 4)
    # A wrapper named in the config is kept.
    eager = base.replace(device__graph_wrapper_cls="kiln.worker.graph.EagerGraphWrapper")
    assert _graph_mode(eager, "trace").device.graph_wrapper_cls.endswith("EagerGraphWrapper")
