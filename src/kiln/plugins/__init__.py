"""Kiln's plugin system: discovery, the per-process lifecycle, registries, and introspection.

``init_process(role, config)`` is the one call each process makes before building an engine part.
This package's ``__init__`` imports nothing else, so that ``kiln.plugins.registry`` can be used by
the registries themselves without import cycles.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kiln.config import KilnConfig

ROLES = ("api", "engine", "worker", "offline")


def init_process(role: str, config: KilnConfig) -> KilnConfig:
    """Run the plugin lifecycle for this process and return the platform-updated config.

    Phases, in this order: discover -> select platform (recorded in ``kiln.platforms``, which
    points the custom ops' dispatch at its device type) -> register (Kiln's ops, general plugins,
    the platform's ``register_ops``, platform-scope patches) -> configure -> the platform's
    ``init_process(role, config)`` -> (workers only) worker-scope patches. Each runs once per
    process, but configure, which runs for every ``config`` (the platform checks and fills each).
    A later call may not force another platform.

    Raises:
        ValueError: unknown ``role``, or a config the platform or a plugin rejects.
        PlatformSelectionError: no usable platform, or another than the one already selected
            (see ``kiln.plugins.manager``).
    """
    from kiln.platforms import set_current_platform
    from kiln.plugins.manager import get_plugin_manager

    if role not in ROLES:
        raise ValueError(f"role={role!r} is invalid; allowed: {list(ROLES)}")
    manager = get_plugin_manager()
    manager.role = role
    manager.discover()
    platform_cls = manager.select_platform(config.device.platform)
    set_current_platform(platform_cls, role)
    manager.load_general_plugins()
    config = manager.configure(config)
    manager.init_platform_process(config)
    if role == "worker":
        manager.init_worker()
    return config
