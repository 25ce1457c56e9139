"""Fixtures shared by every test directory: the default model and a ``transformers`` reference
built from the same GGUF (``kiln.testing.reference``). Session-scoped: building the reference
takes several seconds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kiln.model_executor.loader.default_model import default_model_path
from kiln.testing.reference import hf_greedy, hf_logits, hf_model_from_gguf


@pytest.fixture(scope="session")
def gguf_path() -> str:
    try:
        return default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def hf_model(gguf_path: str) -> torch.nn.Module:
    return hf_model_from_gguf(gguf_path)


@pytest.fixture(scope="session")
def hf_ref() -> SimpleNamespace:
    """``transformers`` reference helpers: ``greedy(model, prompt, n)``, ``logits(model, ids)``."""
    return SimpleNamespace(greedy=hf_greedy, logits=hf_logits)
