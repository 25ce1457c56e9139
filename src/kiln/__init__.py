"""Kiln: an LLM inference and serving engine whose hardware support comes from platform plugins.

Importing ``kiln`` is cheap and selects nothing: a process selects its platform when it starts its
plugin lifecycle (``kiln.plugins.init_process``), and the public classes below are imported on
first access.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "SamplingParams": "kiln.sampling_params",
    "LLM": "kiln.entrypoints.llm",
    "KilnConfig": "kiln.config",
    "LoRARequest": "kiln.lora.request",
    "PoolingParams": "kiln.pooling_params",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kiln' has no attribute {name!r}")


__all__ = ["__version__", *_LAZY]
