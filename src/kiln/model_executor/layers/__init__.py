"""Kiln's layers: each dispatchable one is a ``CustomOp`` registered under its op name when its
module is imported.

``import_builtin_ops()`` imports every layer module, so that the op registry holds all of Kiln's
ops before any plugin registers implementations for them; the plugin lifecycle calls it at the
start of the register phase in every process (``kiln plugins`` and the conformance kit then see
the ops without building a model).
"""

from __future__ import annotations

import importlib
import pkgutil


def import_builtin_ops() -> None:
    """Import every module under ``kiln.model_executor.layers`` (idempotent)."""
    for module in pkgutil.walk_packages(__path__, __name__ + "."):
        importlib.import_module(module.name)
