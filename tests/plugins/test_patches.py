"""The patch registry applies declared patches, and refuses them when the target drifted."""

import sys
import textwrap
import types

import pytest

from kiln.patches import PatchRegistry, fingerprint


@pytest.fixture
def target_module():
    module = types.ModuleType("kiln_patch_target")
    source = textwrap.dedent(
        """
        class Engine:
            def step(self):
                return "original"
        """
    )
    exec(compile(source, "<kiln_patch_target>", "exec"), module.__dict__)
    sys.modules["kiln_patch_target"] = module
    yield module
    del sys.modules["kiln_patch_target"]


def _patched_step(self):
    return "patched"


def test_a_patch_with_a_matching_fingerprint_is_applied_in_its_scope_only(target_module):
    registry = PatchRegistry()
    target = "kiln_patch_target:Engine.step"
    patch = registry.register(
        target, _patched_step, scope="worker", reason="test", fingerprint=fingerprint(target)
    )
    registry.apply("platform")
    assert patch.status == "pending" and target_module.Engine().step() == "original"
    registry.apply("worker")
    assert patch.status == "applied" and target_module.Engine().step() == "patched"
    registry.revert_all()
    assert target_module.Engine().step() == "original"


def test_a_changed_target_is_refused_or_warned_as_the_plugin_chose(target_module):
    target = "kiln_patch_target:Engine.step"
    registry = PatchRegistry()
    refused = registry.register(
        target, _patched_step, scope="platform", reason="test", fingerprint="0" * 16
    )
    registry.apply("platform")
    assert refused.status == "refused"
    assert "fingerprint" in refused.detail
    assert target_module.Engine().step() == "original"

    registry = PatchRegistry()
    warned = registry.register(
        target,
        _patched_step,
        scope="platform",
        reason="test",
        fingerprint="0" * 16,
        on_mismatch="warn",
    )
    registry.apply("platform")
    assert warned.status == "applied-with-warning"
    assert target_module.Engine().step() == "patched"
    registry.revert_all()


def test_a_missing_target_is_refused(target_module):
    registry = PatchRegistry()
    patch = registry.register(
        "kiln_patch_target:Engine.gone",
        _patched_step,
        scope="platform",
        reason="r",
        fingerprint="x",
    )
    registry.apply("platform")
    assert patch.status == "refused" and "'gone' is missing" in patch.detail


def test_fingerprint_follows_the_source(target_module):
    target = "kiln_patch_target:Engine.step"
    before = fingerprint(target)
    exec("def step(self):\n    return 'changed'\n", target_module.__dict__)
    target_module.Engine.step = target_module.step
    # Source of exec'd code is not retrievable: the fingerprint falls back to repr, which differs.
    assert fingerprint(target) != before


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"scope": "everywhere"}, "scope='everywhere' is invalid"),
        ({"on_mismatch": "ignore"}, "on_mismatch='ignore' is invalid"),
        ({"reason": " "}, "needs a reason"),
    ],
)
def test_bad_declarations_are_rejected(kwargs, needle):
    args = {"scope": "platform", "reason": "r", "fingerprint": "f", **kwargs}
    with pytest.raises(ValueError, match=needle):
        PatchRegistry().register("a.b:C.d", _patched_step, **args)


def test_two_plugins_cannot_patch_the_same_target():
    registry = PatchRegistry()
    registry.register("a.b:C.d", _patched_step, scope="platform", reason="r", fingerprint="f")
    with pytest.raises(ValueError, match="already patched"):
        registry.register("a.b:C.d", lambda self: 1, scope="platform", reason="r", fingerprint="f")


def test_target_syntax_is_checked():
    with pytest.raises(ValueError, match="must look like 'package.module:Qualname.attr'"):
        PatchRegistry().register(
            "a.b.C.d", _patched_step, scope="platform", reason="r", fingerprint="f"
        )
