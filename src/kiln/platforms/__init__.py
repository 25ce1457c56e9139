"""``current_platform``: the platform of this process, resolved lazily on first access.

Lazy because plugins import ``kiln.platforms.interface`` to subclass ``Platform``, and importing
``kiln`` must not select anything. Resolution follows ``PluginManager.select_platform``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kiln.platforms.interface import PLATFORM_API_VERSION, Platform

if TYPE_CHECKING:
    current_platform: type[Platform]


def __getattr__(name: str) -> Any:
    if name == "current_platform":
        from kiln.plugins.manager import get_plugin_manager

        return get_plugin_manager().select_platform()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["PLATFORM_API_VERSION", "Platform", "current_platform"]
