"""The plugin lifecycle of a process: its phases run once each, in order, driven by
``kiln.plugins.init_process`` alone; the platform is selected there, never by a layer's forward.
Each case runs in a fresh process: a process selects its platform once."""

import json

from kiln.testing import run_python

RECORD_HOOKS = """
import json
from kiln.config import DeviceConfig, KilnConfig, SchedulerConfig
from kiln.platforms.cpu import CpuPlatform
from kiln.plugins import init_process
from kiln.plugins.manager import PlatformSelectionError, get_plugin_manager

CALLS = []
register_ops = CpuPlatform.register_ops.__func__
check_and_update_config = CpuPlatform.check_and_update_config.__func__
init_platform = CpuPlatform.init_process.__func__


def recorded_register_ops(cls):
    CALLS.append("register_ops")
    register_ops(cls)


def recorded_check_and_update_config(cls, config):
    CALLS.append(f"check_and_update_config {config.scheduler.max_num_seqs}")
    return check_and_update_config(cls, config)


def recorded_init_process(cls, role, config):
    CALLS.append(f"init_process {role}")
    init_platform(cls, role, config)


CpuPlatform.register_ops = classmethod(recorded_register_ops)
CpuPlatform.check_and_update_config = classmethod(recorded_check_and_update_config)
CpuPlatform.init_process = classmethod(recorded_init_process)

def config(max_num_seqs):
    return KilnConfig(
        device=DeviceConfig(platform="cpu"), scheduler=SchedulerConfig(max_num_seqs=max_num_seqs)
    )


first, second = init_process("worker", config(3)), init_process("worker", config(5))
get_plugin_manager().init_worker()  # what an executor calls in its worker, again
try:
    init_process("worker", KilnConfig(device=DeviceConfig(platform="kiln_test")))
    switched = "switched"
except PlatformSelectionError as exc:
    switched = str(exc)
print(json.dumps({
    "calls": CALLS,
    "phases": get_plugin_manager().phases,
    "filled": [first.device.worker_cls != "auto", second.scheduler.max_num_seqs],
    "switched": switched,
}))
"""


def test_each_phase_runs_once_in_order_and_configure_once_per_config():
    proc = run_python(["-c", RECORD_HOOKS], {"KILN_TEST_PLATFORM": "1"})
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["calls"] == [
        "register_ops",
        "check_and_update_config 3",
        "init_process worker",
        "check_and_update_config 5",
    ]
    assert result["phases"] == [
        "discover",
        "select",
        "register",
        "configure",
        "init-process",
        "init-worker",
    ]
    assert result["filled"] == [True, 5]
    assert "already selected in this process; cannot switch to 'kiln_test'" in result["switched"]


FORWARD_BEFORE_THE_LIFECYCLE = """
import json
import torch
import kiln.platforms
from kiln.config import KilnConfig
from kiln.model_executor.custom_op import OP_REGISTRY, register_impl
from kiln.model_executor.layers.layernorm import RMSNorm
from kiln.plugins import init_process
from kiln.plugins.manager import get_plugin_manager

CALLS = []


@register_impl("rms_norm", "recorder", device_type="cpu", priority=1000)
def recorded(op, x, residual=None):
    CALLS.append(tuple(x.shape))
    return op.forward_native(x, residual)


norm, x = RMSNorm(8), torch.randn(2, 8)
norm(x)
before = {
    "phases": list(get_plugin_manager().phases),
    "impl": norm.selected_impl(x),
    "calls": len(CALLS),
}
try:
    kiln.platforms.current_platform
    before["current_platform"] = "selected"
except RuntimeError as exc:
    before["current_platform"] = str(exc)
init_process("offline", KilnConfig())
norm(x)
after = {
    "device_type": OP_REGISTRY.device_type,
    "impl": norm.selected_impl(x),
    "calls": len(CALLS),
    "platform": kiln.platforms.current_platform.name,
}
print(json.dumps({"before": before, "after": after}))
"""


def test_a_forward_before_the_lifecycle_selects_nothing_and_runs_the_reference():
    proc = run_python(["-c", FORWARD_BEFORE_THE_LIFECYCLE])
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    before, after = result["before"], result["after"]
    assert before["phases"] == [] and before["impl"] == "native" and before["calls"] == 0
    assert "no platform is selected in this process yet" in before["current_platform"]
    # The lifecycle points dispatch at the selected platform's device: the same layer now takes
    # the registered implementation.
    assert after == {"device_type": "cpu", "impl": "recorder", "calls": 1, "platform": "cpu"}
