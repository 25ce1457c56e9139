"""Fixtures of kiln-x86's tests: the default model's GGUF (installed with Kiln)."""

import pytest

from kiln.model_executor.loader.default_model import default_model_path


@pytest.fixture(scope="session")
def gguf_path() -> str:
    return default_model_path()
