"""Registries refuse silent replacement; op dispatch follows priority and predicates."""

import pytest
import torch

from kiln.model_executor.custom_op import OP_REGISTRY, CustomOp
from kiln.model_executor.loader import get_loader
from kiln.model_executor.registry import resolve_model_cls
from kiln.plugins.registry import Registry, registering_as


def test_registering_an_existing_name_needs_override_and_is_recorded():
    reg = Registry("model")
    reg.register("Arch", "a.B")
    reg.register("Arch", "a.B")  # the same value again: idempotent, no override
    assert reg.overrides == []
    with pytest.raises(ValueError, match="'Arch' is already registered .*override=True"):
        reg.register("Arch", "c.D")
    assert reg.get("Arch") == "a.B"
    with registering_as("my_plugin"):
        reg.register("Arch", "c.D", override=True)
    assert reg.get("Arch") == "c.D"
    (override,) = reg.overrides
    assert (override.old, override.new, override.old_source, override.source) == (
        "a.B",
        "c.D",
        "kiln",
        "my_plugin",
    )


def test_unknown_names_list_the_registered_ones():
    reg = Registry("loader")
    reg.register("x", "m.X")
    with pytest.raises(KeyError, match=r"unknown loader 'y'; registered: \['x'\]"):
        reg.get("y")


def test_unknown_architecture_names_the_supported_ones():
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        resolve_model_cls(["GPT2LMHeadModel"])


def test_unknown_load_format_names_the_allowed_ones():
    with pytest.raises(ValueError, match=r"load_format='npz'.*'gguf'"):
        get_loader("x", load_format="npz")


class _Double(CustomOp):
    def forward_native(self, x):
        return x * 2


OP_REGISTRY.register_op("test_double")(_Double)


@pytest.fixture
def dispatch_on_cpu():
    """Ops dispatch on the cpu device type, as after the lifecycle selected a cpu platform."""
    before = OP_REGISTRY.device_type
    OP_REGISTRY.select_device("cpu")
    yield
    OP_REGISTRY.select_device(before)


def _impl(tag):
    def fn(op, x):
        fn.calls += 1
        return x * 2

    fn.calls = 0
    fn.__qualname__ = f"impl_{tag}"
    return fn


def test_dispatch_picks_the_highest_priority_implementation_that_supports_the_call(
    dispatch_on_cpu,
):
    op = _Double()
    x32, x64 = torch.ones(3), torch.ones(3, dtype=torch.float64)
    assert op.selected_impl(x32) == "native"
    low, high = _impl("low"), _impl("high")
    OP_REGISTRY.register_impl("test_double", "low", device_type="cpu", priority=1)(low)
    OP_REGISTRY.register_impl(
        "test_double",
        "high",
        device_type="cpu",
        priority=5,
        supports=lambda op, x: x.dtype == torch.float32,
    )(high)
    # Another device's implementation never runs here, whatever its priority.
    OP_REGISTRY.register_impl("test_double", "npu", device_type="npu", priority=100)(_impl("npu"))
    assert torch.equal(op(x32), x32 * 2)
    assert (high.calls, low.calls) == (1, 0)
    assert torch.equal(op(x64), x64 * 2)  # predicate refuses float64: next by priority
    assert (high.calls, low.calls) == (1, 1)
    assert op.selected_impl(x32) == "high" and op.selected_impl(x64) == "low"
    # No device selected (no platform yet): the reference, whatever is registered.
    OP_REGISTRY.select_device(None)
    assert torch.equal(op(x32), x32 * 2) and high.calls == 1
    assert op.selected_impl(x32) == "native"


def test_replacing_an_implementation_needs_override():
    first, second = _impl("first"), _impl("second")
    OP_REGISTRY.register_impl("test_double", "prov", device_type="cpu")(first)
    OP_REGISTRY.register_impl("test_double", "prov", device_type="cpu")(first)  # idempotent
    with pytest.raises(ValueError, match="provider 'prov' for device 'cpu'.*override=True"):
        OP_REGISTRY.register_impl("test_double", "prov", device_type="cpu")(second)
    before = len(OP_REGISTRY.overrides)
    OP_REGISTRY.register_impl("test_double", "prov", device_type="cpu", override=True)(second)
    assert len(OP_REGISTRY.overrides) == before + 1
    assert OP_REGISTRY.overrides[-1].new.endswith("impl_second")


def test_registering_an_op_that_is_not_a_custom_op_fails():
    with pytest.raises(TypeError, match="must subclass CustomOp"):
        OP_REGISTRY.register_op("not_an_op")(int)
