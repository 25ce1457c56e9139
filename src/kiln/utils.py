"""Small helpers shared across Kiln. Nothing here knows about models or devices."""

from __future__ import annotations

import importlib
from typing import Any


def resolve_obj_by_qualname(qualname: str) -> Any:
    """Import ``"pkg.mod.Name"`` (or ``"pkg.mod:Name"``) and return the object.

    Raises:
        ImportError: the module cannot be imported (the message names the path).
        AttributeError: the module has no such attribute.
    """
    if ":" in qualname:
        module_name, _, attr_path = qualname.partition(":")
    else:
        module_name, _, attr_path = qualname.rpartition(".")
    if not module_name or not attr_path:
        raise ImportError(f"{qualname!r} is not a dotted path like 'package.module.Name'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(f"cannot import {module_name!r} for {qualname!r}: {exc}") from exc
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise AttributeError(f"{module_name!r} has no attribute {attr_path!r}") from None
    return obj


def qualname_of(obj: Any) -> str:
    """``"module.Qualname"`` of a class or function."""
    return f"{obj.__module__}.{obj.__qualname__}"
