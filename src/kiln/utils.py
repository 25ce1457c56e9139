"""Small helpers shared across Kiln. Nothing here knows about models or devices."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from kiln.plugins.registry import Registry

T = TypeVar("T")


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


def resolve_registered_class(
    registry: Registry[str], name: str, base: type[T], flag: str
) -> type[T]:
    """The class that ``registry`` names ``name`` (a dotted path), checked to subclass ``base``.

    Raises:
        ValueError: unknown name (the message lists the registered ones, under ``flag``), or
            the entry is not a subclass of ``base``.
    """
    if name not in registry:
        raise ValueError(
            f"{flag} {name!r} is not registered; registered: {sorted(registry.names())}"
        )
    cls = resolve_obj_by_qualname(registry.get(name))
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ValueError(
            f"{registry.kind} {name!r} ({registry.get(name)}) is not a subclass of "
            f"{base.__module__}.{base.__qualname__}"
        )
    return cls


def split_partial_tag(text: str, tag: str) -> tuple[str, str]:
    """``text`` cut before its longest suffix that starts ``tag`` (which may still arrive):
    ``(safe, held)``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return text[:-size], text[-size:]
    return text, ""
