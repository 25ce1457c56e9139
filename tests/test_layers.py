"""Imports between Kiln's packages go down the layers of ``scripts/measure.py`` (``LAYERS``), never
up: a module may import its own layer and the layers below it."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _measure():
    spec = importlib.util.spec_from_file_location("kiln_measure", ROOT / "scripts" / "measure.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


measure = _measure()


def test_no_upward_import():
    upward = measure.upward_arrows()
    assert not upward, f"imports into a higher layer (see LAYERS in scripts/measure.py): {upward}"


def test_every_unit_has_a_layer():
    for a, b in measure.import_arrows():
        measure.layer_of(a)
        measure.layer_of(b)


def test_an_upward_import_is_found(tmp_path):
    package = tmp_path / "kiln"
    (package / "scheduler").mkdir(parents=True)
    (package / "engine").mkdir()
    (package / "scheduler" / "request.py").write_text("def f():\n    from kiln.engine import x\n")
    (package / "engine" / "__init__.py").write_text("from kiln.scheduler.request import f\n")
    assert measure.upward_arrows(package) == {
        ("scheduler", "engine"): ["kiln/scheduler/request.py:2"]
    }


def test_a_unit_on_its_own_sits_in_its_own_layer():
    assert measure.unit_of("plugins.registry") == "plugins.registry"
    assert measure.unit_of("plugins.manager") == "plugins"
    assert measure.layer_of("plugins.registry") < measure.layer_of("model_executor")
    with pytest.raises(ValueError, match="no layer"):
        measure.layer_of("nowhere")
