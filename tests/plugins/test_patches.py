"""The patch registry applies declared patches, and refuses them when the target drifted."""

import importlib
import sys
import textwrap
import types

import pytest

from kiln.patches import PatchError, PatchRegistry, fingerprint
from kiln.testing import run_python


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


def test_fingerprint_follows_the_source(tmp_path, monkeypatch):
    # A real module file whose source changes, as Kiln's own does between releases.
    path = tmp_path / "kiln_fingerprint_target.py"
    path.write_text("class Engine:\n    def step(self):\n        return 'original'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import kiln_fingerprint_target

    try:
        target = "kiln_fingerprint_target:Engine.step"
        before = fingerprint(target)
        assert fingerprint(target) == before
        path.write_text("class Engine:\n    def step(self):\n        return 'changed now'\n")
        importlib.reload(kiln_fingerprint_target)
        changed = fingerprint(target)
        assert changed != before
        # Trailing blanks do not count; the code does.
        path.write_text("class Engine:\n    def step(self):   \n        return 'changed now'\n")
        importlib.reload(kiln_fingerprint_target)
        assert fingerprint(target) == changed
    finally:
        del sys.modules["kiln_fingerprint_target"]


FINGERPRINT_OF_EXEC_CODE = """
import sys, types
from kiln.patches import fingerprint
module = types.ModuleType("kiln_exec_target")
exec("class Engine:\\n    def step(self):\\n        return " + sys.argv[1], module.__dict__)
sys.modules["kiln_exec_target"] = module
print(fingerprint("kiln_exec_target:Engine.step"))
"""


def test_fingerprint_of_code_without_source_is_the_same_in_every_process():
    # Without source the fingerprint once hashed repr(func), which holds a memory address: each
    # process got another one, and a patch of such a target was always refused.
    def run(body):
        proc = run_python(["-c", FINGERPRINT_OF_EXEC_CODE, body])
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    first, second = run("'original'"), run("'original'")
    assert first == second
    assert run("'changed'") != first


def test_a_target_without_anything_stable_to_hash_cannot_be_fingerprinted(target_module):
    target_module.Engine.handler = object()
    with pytest.raises(PatchError, match="nothing stable to fingerprint"):
        fingerprint("kiln_patch_target:Engine.handler")


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
