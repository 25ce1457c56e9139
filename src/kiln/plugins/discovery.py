"""Finding plugins: entry points in Kiln's two groups, and what became of each.

``kiln.platform_plugins``: ``name = "pkg:detect"``; ``detect()`` returns the dotted path of a
``Platform`` subclass when its hardware is present, else None, and has no side effects. ``name``
must equal that class's ``Platform.name`` (Kiln refuses the platform otherwise): it is the name
``--platform``, ``KILN_PLATFORM`` and ``--plugin-config`` use.

``kiln.general_plugins``: ``name = "pkg:register"``; ``register()`` adds models, loaders, ops,
patches and config sections to Kiln's registries. It runs once in every process that builds an
engine part and must be idempotent. ``KILN_PLUGINS=a,b`` limits which run (unset: all; empty:
none); it never applies to platform plugins.

This module only finds and describes entry points; ``kiln.plugins.manager`` decides what runs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import metadata

PLATFORM_GROUP = "kiln.platform_plugins"
GENERAL_GROUP = "kiln.general_plugins"
PLUGINS_ENV = "KILN_PLUGINS"


@dataclass
class PluginRecord:
    """One entry point and its fate in this process (shown by ``kiln plugins``)."""

    group: str
    name: str
    value: str
    """``module:attr`` as written in the entry point."""
    distribution: str
    """``name version`` of the package that declares it (``kiln`` for built-ins)."""
    status: str = "found"
    """found | loaded | filtered | failed (general plugins); for platform detectors:
    active | chosen | inactive | error | not-run | refused."""
    detail: str = ""
    """The platform path a detector returned, why a plugin was filtered, or the error."""
    traceback: str = ""
    """The full traceback when a plugin or detector raised."""

    def as_dict(self) -> dict[str, object]:
        return {
            "group": self.group,
            "name": self.name,
            "value": self.value,
            "distribution": self.distribution,
            "status": self.status,
            "detail": self.detail,
            "traceback": self.traceback,
        }


def find_entry_points(group: str) -> list[metadata.EntryPoint]:
    """Every entry point in ``group``, sorted by name, duplicates (same name and value) dropped."""
    seen: dict[tuple[str, str], metadata.EntryPoint] = {}
    for ep in metadata.entry_points(group=group):
        seen.setdefault((ep.name, ep.value), ep)
    return sorted(seen.values(), key=lambda ep: ep.name)


def distribution_of(ep: metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "unknown"
    return f"{dist.metadata['Name']} {dist.version}"


def plugin_allowlist() -> set[str] | None:
    """The names in ``KILN_PLUGINS`` (None when unset, meaning every general plugin)."""
    raw = os.environ.get(PLUGINS_ENV)
    if raw is None:
        return None
    return {name.strip() for name in raw.split(",") if name.strip()}
