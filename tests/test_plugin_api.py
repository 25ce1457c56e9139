"""``kiln.plugin_api`` is the one module plugins import Kiln from: each of its names resolves, the
guide's list is generated from it, and kiln-x86, the scaffold and the test plugin import nothing
else of Kiln (imports parsed with ``ast``, inside functions and ``TYPE_CHECKING`` blocks too)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import pathlib
import sys

import pytest

import kiln.plugin_api
from kiln.entrypoints.plugin_new import render_plugin
from kiln.testing import run_python

ROOT = pathlib.Path(__file__).resolve().parent.parent
ALLOWED = ("kiln.plugin_api", "kiln.plugin_api.conformance")


def _doc_script():
    path = ROOT / "scripts" / "plugin_api_doc.py"
    spec = importlib.util.spec_from_file_location("kiln_plugin_api_doc", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def kiln_imports(source: str, where: str) -> list[str]:
    """``"where:line module.name"`` for every import of Kiln outside ``ALLOWED`` in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            modules = [(alias.name, "") for alias in node.names]
        else:
            continue
        for module, name in modules:
            is_kiln = module == "kiln" or module.startswith("kiln.")
            if is_kiln and module not in ALLOWED:
                found.append(f"{where}:{node.lineno} {module}{'.' + name if name else ''}")
    return found


def _plugin_sources() -> dict[str, str]:
    sources = {}
    for root in ("plugins/kiln-x86/src", "tests/plugins/kiln_test_plugin/src"):
        for path in sorted((ROOT / root).rglob("*.py")):
            sources[str(path.relative_to(ROOT))] = path.read_text(encoding="utf-8")
    for path, text in render_plugin("toy").items():
        if path.endswith(".py"):
            sources[f"kiln plugin new toy: {path}"] = text
    return sources


def test_plugins_import_kiln_only_through_the_plugin_api():
    sources = _plugin_sources()
    assert any("kiln_x86" in p for p in sources) and any("kiln_toy" in p for p in sources)
    outside = [hit for where, text in sources.items() for hit in kiln_imports(text, where)]
    assert not outside, "imports of Kiln outside kiln.plugin_api:\n" + "\n".join(outside)


def test_the_import_check_finds_an_import_outside_the_api():
    source = (
        "from kiln.plugin_api import Platform\n"
        "import kiln.config\n"
        "def f():\n"
        "    from kiln.platforms.cpu import CpuPlatform\n"
    )
    assert kiln_imports(source, "x.py") == [
        "x.py:2 kiln.config",
        "x.py:4 kiln.platforms.cpu.CpuPlatform",
    ]


def test_every_name_resolves_to_the_object_of_its_old_path():
    for group in kiln.plugin_api.API.values():
        for name, api in group.items():
            if name == "current_platform":
                continue  # an error before the lifecycle selects a platform
            old = getattr(importlib.import_module(api.module), name)
            assert getattr(kiln.plugin_api, name) is old, name
            assert api.contract, name
    assert kiln.plugin_api.__all__ == [n for g in kiln.plugin_api.API.values() for n in g]


def test_a_name_outside_the_api_is_refused_with_where_to_look():
    with pytest.raises(AttributeError, match="not part of Kiln's plugin API"):
        kiln.plugin_api.CPUPrefill  # noqa: B018


def test_importing_the_api_imports_nothing_else_of_kiln():
    code = (
        "import sys, kiln.plugin_api\n"
        "print(sorted(m for m in sys.modules if m.startswith('kiln.')))\n"
    )
    proc = run_python(["-c", code])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['kiln.plugin_api']"


def test_the_guide_lists_exactly_the_api():
    script = _doc_script()
    text = script.GUIDE.read_text(encoding="utf-8")
    assert script.with_list(text) == text, (
        "docs/plugins.md's plugin-API list differs from kiln.plugin_api: run "
        "scripts/plugin_api_doc.py"
    )
    for name in kiln.plugin_api.__all__:
        assert f"| `{name}` |" in script.render()


def test_the_guide_check_sees_a_stale_list():
    script = _doc_script()
    stale = script.with_list(script.GUIDE.read_text(encoding="utf-8")).replace(
        "| `CpuPlatform` |", "| `CpuPlatformX` |"
    )
    assert script.with_list(stale) != stale
