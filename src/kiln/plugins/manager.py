"""The plugin lifecycle of one process: discover -> select platform -> register -> configure ->
init-process -> (workers) init-worker.

``kiln.plugins.init_process`` is the one driver: it calls the phases in that order, and each phase
does its own work only (none calls another); the process phases run once per process, configure
once per config the process builds an engine from. The manager remembers what happened to every
entry point, detector, config field, registry override and patch, which is what ``kiln plugins``
and ``GET /debug/plugins`` show.
"""

from __future__ import annotations

import logging
import os
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kiln.config import AUTO, KilnConfig
from kiln.model_executor.layers import import_builtin_ops
from kiln.patches import PATCH_REGISTRY, PatchRegistry
from kiln.platforms.interface import PLATFORM_API_VERSION, Platform, api_major
from kiln.plugins.config import PLUGIN_CONFIG_REGISTRY
from kiln.plugins.discovery import (
    GENERAL_GROUP,
    PLATFORM_GROUP,
    PluginRecord,
    distribution_of,
    find_entry_points,
    plugin_allowlist,
)
from kiln.plugins.interfaces import CLASS_FIELDS, InterfaceError, check_implements
from kiln.plugins.registry import registering_as
from kiln.utils import resolve_obj_by_qualname

logger = logging.getLogger(__name__)

PLATFORM_ENV = "KILN_PLATFORM"

# Built-in detectors, tried after the out-of-tree ones. Each returns a dotted path or None.
BUILTIN_DETECTORS = {"cpu": "kiln.platforms.cpu:cpu_platform_plugin"}


class PlatformSelectionError(RuntimeError):
    """No platform, or more than one, or a refused one."""


@dataclass
class PlatformChoice:
    name: str
    qualname: str
    reason: str
    platform_cls: type[Platform]


@dataclass
class PluginManager:
    """What this process found, chose and changed. One per process (see ``get_plugin_manager``)."""

    platform_records: list[PluginRecord] = field(default_factory=list)
    general_records: list[PluginRecord] = field(default_factory=list)
    choice: PlatformChoice | None = None
    config_changes: list[tuple[str, Any, Any]] = field(default_factory=list)
    patches: PatchRegistry = field(default_factory=lambda: PATCH_REGISTRY)
    phases: list[str] = field(default_factory=list)
    """The phases that ran in this process, each named once, in the order they first ran."""
    role: str | None = None
    """What this process is: api, engine (beside an API server), worker or offline."""

    # -- phase 1: discover ------------------------------------------------------------------------
    def discover(self) -> None:
        """Find the entry points of both groups (loads nothing)."""
        if "discover" in self.phases:
            return
        builtin = [
            PluginRecord(PLATFORM_GROUP, name, value, "kiln (built-in)")
            for name, value in BUILTIN_DETECTORS.items()
        ]
        external = [
            PluginRecord(PLATFORM_GROUP, ep.name, ep.value, distribution_of(ep))
            for ep in find_entry_points(PLATFORM_GROUP)
        ]
        self.platform_records = external + builtin
        self.general_records = [
            PluginRecord(GENERAL_GROUP, ep.name, ep.value, distribution_of(ep))
            for ep in find_entry_points(GENERAL_GROUP)
        ]
        self.phases.append("discover")

    # -- phase 2: select the platform ---------------------------------------------------------
    def select_platform(self, forced: str | None = None) -> type[Platform]:
        """Run the detectors of the discovered platforms and choose one (once per process; later
        calls return the choice).

        Rules: ``forced`` (or ``KILN_PLATFORM``) runs only that detector; otherwise exactly one
        activating out-of-tree platform wins over the built-ins, two are an error naming both,
        and a detector that raises is recorded with its traceback and counts as inactive.

        Raises:
            PlatformSelectionError: unknown forced name, a forced platform that finds no device,
                two activating out-of-tree platforms, or a platform refused by its api_version.
        """
        if self.choice is not None:
            if forced and forced != self.choice.name:
                raise PlatformSelectionError(
                    f"platform {self.choice.name!r} was already selected in this process; "
                    f"cannot switch to {forced!r}"
                )
            return self.choice.platform_cls
        assert "discover" in self.phases, "select_platform runs after discover"
        forced = forced or os.environ.get(PLATFORM_ENV) or None
        builtin_names = set(BUILTIN_DETECTORS)
        if forced:
            by_name = {r.name: r for r in self.platform_records}
            if forced not in by_name:
                raise PlatformSelectionError(
                    f"platform {forced!r} (from --platform / {PLATFORM_ENV}) is not installed; "
                    f"available: {sorted(by_name)} (the names of the kiln.platform_plugins "
                    "entry points, which equal each platform's Platform.name)"
                )
            for record in self.platform_records:
                if record.name != forced:
                    record.status, record.detail = "not-run", f"platform forced to {forced!r}"
            record = by_name[forced]
            self._run_detector(record)
            if record.status != "active":
                raise PlatformSelectionError(
                    f"platform {forced!r} was forced but its detector found no device "
                    f"({record.status}: {record.detail or 'returned None'})"
                )
            return self._choose(record, f"forced by --platform/{PLATFORM_ENV}={forced}")
        for record in self.platform_records:
            self._run_detector(record)
        active_external = [
            r for r in self.platform_records if r.status == "active" and r.name not in builtin_names
        ]
        if len(active_external) > 1:
            names = ", ".join(f"{r.name} ({r.distribution})" for r in active_external)
            raise PlatformSelectionError(
                f"more than one platform plugin activated: {names}; uninstall one or choose with "
                f"--platform NAME / {PLATFORM_ENV}=NAME"
            )
        if active_external:
            return self._choose(active_external[0], "the only out-of-tree platform that activated")
        active_builtin = [r for r in self.platform_records if r.status == "active"]
        if not active_builtin:
            raise PlatformSelectionError("no platform activated (see `kiln plugins`)")
        return self._choose(active_builtin[0], "no out-of-tree platform activated; built-in")

    def _run_detector(self, record: PluginRecord) -> None:
        try:
            detector = resolve_obj_by_qualname(record.value)
            result = detector()
        except Exception as exc:  # a broken plugin must not take Kiln down, nor hide
            record.status, record.detail = "error", f"{type(exc).__name__}: {exc}"
            record.traceback = traceback.format_exc()
            logger.warning("platform detector %s raised: %s", record.name, record.detail)
            return
        if result is None:
            record.status, record.detail = "inactive", "no device found"
        elif isinstance(result, str):
            record.status, record.detail = "active", result
        else:
            record.status = "error"
            record.detail = f"returned {result!r}; a detector must return a dotted path or None"

    def _choose(self, record: PluginRecord, reason: str) -> type[Platform]:
        try:
            platform_cls = resolve_obj_by_qualname(record.detail)
        except (ImportError, AttributeError) as exc:
            raise PlatformSelectionError(f"platform {record.name!r}: {exc}") from exc
        if not (isinstance(platform_cls, type) and issubclass(platform_cls, Platform)):
            raise PlatformSelectionError(
                f"platform {record.name!r}: {record.detail} is not a kiln Platform subclass"
            )
        version = getattr(platform_cls, "api_version", "?")
        try:
            compatible = api_major(version) == api_major(PLATFORM_API_VERSION)
        except ValueError:
            compatible = False
        if not compatible:
            record.status = "refused"
            raise PlatformSelectionError(
                f"platform {record.name!r} ({record.distribution}) was written for platform API "
                f"{version}, but this Kiln provides API {PLATFORM_API_VERSION}: the major versions "
                "differ; install a release of the plugin built for this Kiln"
            )
        try:
            # Overridden hooks must keep the Platform signatures the core calls them with.
            check_implements(platform_cls, Platform)
        except InterfaceError as exc:
            record.status = "refused"
            raise PlatformSelectionError(f"platform {record.name!r}: {exc}") from exc
        if platform_cls.name != record.name:
            record.status = "refused"
            raise PlatformSelectionError(
                f"platform {record.name!r} ({record.distribution}): {record.detail}.name is "
                f"{platform_cls.name!r}, but its entry point is named {record.name!r}; they must "
                "be equal (the entry-point name is what --platform, KILN_PLATFORM and "
                "--plugin-config use): rename one of them"
            )
        if platform_cls.config_section is not None:
            with registering_as(record.name):
                PLUGIN_CONFIG_REGISTRY.declare(record.name, platform_cls.config_section)
        record.status = "chosen"
        self.choice = PlatformChoice(record.name, record.detail, reason, platform_cls)
        self.phases.append("select")
        logger.info("platform %s selected (%s)", record.name, reason)
        return platform_cls

    # -- phase 3: register ------------------------------------------------------------------------
    def load_general_plugins(self) -> None:
        """Run every allowed general plugin's ``register()`` once in this process.

        A plugin that fails is logged and recorded with its traceback; the others still load.
        Kiln's built-in ops are imported first (``import_builtin_ops``). Platform-scope patches
        declared by the plugins are applied at the end of this phase.
        """
        if "register" in self.phases:
            return
        assert self.choice is not None, "the register phase runs after select_platform"
        # Kiln's own ops first: plugins register implementations for them, and the report and
        # the kit must see them whether or not a model was built in this process.
        import_builtin_ops()
        allow = plugin_allowlist()
        eps = {(ep.name, ep.value): ep for ep in find_entry_points(GENERAL_GROUP)}
        for record in self.general_records:
            if allow is not None and record.name not in allow:
                record.status, record.detail = "filtered", "not in KILN_PLUGINS"
                continue
            try:
                with registering_as(record.name):
                    eps[(record.name, record.value)].load()()
            except Exception as exc:
                record.status, record.detail = "failed", f"{type(exc).__name__}: {exc}"
                record.traceback = traceback.format_exc()
                logger.error("general plugin %s failed to load: %s", record.name, record.detail)
                continue
            record.status = "loaded"
        if allow:
            unknown = allow - {r.name for r in self.general_records}
            if unknown:
                logger.warning("KILN_PLUGINS names plugins that are not installed: %s", unknown)
        with registering_as(self.choice.name):
            self.choice.platform_cls.register_ops()
        self.phases.append("register")
        self.patches.apply("platform")

    # -- phase 4: configure -------------------------------------------------------------------
    def configure(self, config: KilnConfig) -> KilnConfig:
        """Let the platform update ``config``; validate plugin config; resolve named classes.

        Runs for every config the process builds an engine from (after register); it changes no
        process state but ``config_changes``.

        Raises:
            ValueError: the platform rejected a setting, or --plugin-config is invalid.
            ImportError / InterfaceError: a named class is missing or does not match its
                interface.
        """
        assert "register" in self.phases and self.choice, "configure runs after register"
        platform_cls = self.choice.platform_cls
        PLUGIN_CONFIG_REGISTRY.validate(config.plugins.sections)
        updated = platform_cls.check_and_update_config(config)
        if not isinstance(updated, KilnConfig):
            raise TypeError(
                f"{platform_cls.__qualname__}.check_and_update_config must return a KilnConfig, "
                f"got {type(updated).__name__}"
            )
        new_changes = [c for c in config.diff(updated) if c[0] != CHANGES_FIELD]
        for old_new in new_changes:
            logger.debug("platform %s set %s: %r -> %r", platform_cls.name, *old_new)
        self.config_changes = merge_changes(config.plugins.platform_changes, new_changes)
        updated = updated.replace(plugins__platform_changes=tuple(self.config_changes))
        unfilled = [name for name in CLASS_FIELDS if getattr(updated.device, name) == AUTO]
        if unfilled:
            raise ValueError(f"platform {platform_cls.name!r} left {unfilled} unset ('auto')")
        if "configure" not in self.phases:
            self.phases.append("configure")
        return updated

    def init_platform_process(self, config: KilnConfig) -> None:
        """Call the platform's ``init_process(role, config)`` once in this process.

        Raises:
            ValueError: the platform cannot honour ``config`` on this machine.
        """
        if "init-process" in self.phases or self.choice is None:
            return
        self.choice.platform_cls.init_process(self.role or "offline", config)
        self.phases.append("init-process")

    # -- worker scope -----------------------------------------------------------------------------
    def init_worker(self) -> None:
        """Apply worker-scope patches, once per process (each worker calls it at init, after
        configure)."""
        if "init-worker" in self.phases:
            return
        self.patches.apply("worker")
        self.phases.append("init-worker")


CHANGES_FIELD = "plugins.platform_changes"


def merge_changes(
    earlier: Sequence[tuple[str, Any, Any]], later: Sequence[tuple[str, Any, Any]]
) -> list[tuple[str, Any, Any]]:
    """The changes of two configure passes in a row (another process's, then this one's): a
    field keeps its first old value and takes its last new one; one changed back is dropped."""
    merged = {name: (old, new) for name, old, new in earlier}
    for name, old, new in later:
        merged[name] = (merged.get(name, (old, new))[0], new)
    return [(name, old, new) for name, (old, new) in merged.items() if old != new]


_MANAGER: PluginManager | None = None


def get_plugin_manager() -> PluginManager:
    """This process's manager (created on first use)."""
    global _MANAGER
    if _MANAGER is None:
        _MANAGER = PluginManager()
    return _MANAGER
