"""Typed config sections that plugins declare, filled from ``--plugin-config``.

A plugin declares its section once, in ``register()``::

    @dataclass(frozen=True)
    class X86Options:
        use_amx: bool = True
        \"\"\"Use AMX tiles for matmuls when the CPU has them.\"\"\"

    PLUGIN_CONFIG_REGISTRY.declare("x86", X86Options)

``--plugin-config '{"x86": {"use_amx": false}}'`` is then validated against it: an unknown section,
an unknown key or a value of the wrong type is a ``ValueError`` naming it and what is allowed.
The plugin reads its values with ``PLUGIN_CONFIG_REGISTRY.get("x86", config)``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from kiln.config import KilnConfig
from kiln.plugins.registry import Registry


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is not None:
        return str(tp).replace("typing.", "")
    return getattr(tp, "__name__", None) or str(tp)


def _field_default(f: dataclasses.Field[Any]) -> Any:
    """A field's default, from its factory if it has one (``register`` made sure of either)."""
    if f.default is not dataclasses.MISSING:
        return f.default
    assert f.default_factory is not dataclasses.MISSING, f.name
    return f.default_factory()


def _matches(value: Any, tp: Any) -> bool:
    """Whether a JSON value fits a dataclass field type (bool, int, float, str, Literal, list,
    dict, Optional/union)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return True
    if origin is typing.Literal:
        return value in typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if origin in (list, tuple) or tp in (list, tuple):
        args = typing.get_args(tp)
        return isinstance(value, list) and all(_matches(v, args[0]) for v in value if args)
    if origin is dict or tp is dict:
        return isinstance(value, dict)
    return isinstance(value, tp) if isinstance(tp, type) else True


class PluginConfigRegistry:
    """Plugin name -> the frozen dataclass of its config section."""

    def __init__(self) -> None:
        self.sections: Registry[type] = Registry("plugin config section")

    def declare(self, plugin: str, schema: type, *, override: bool = False) -> None:
        """Declare ``plugin``'s section. ``schema`` is a dataclass whose fields all have defaults.

        Raises:
            TypeError: ``schema`` is not a dataclass, or a field has no default.
        """
        if not dataclasses.is_dataclass(schema):
            raise TypeError(f"plugin config for {plugin!r} must be a dataclass, got {schema!r}")
        for f in dataclasses.fields(schema):
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise TypeError(f"plugin config {plugin}.{f.name} needs a default")
        self.sections.register(plugin, schema, override=override)

    def validate(self, sections: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """Instances of every declared section, filled from ``sections``.

        Raises:
            ValueError: an unknown section or key, or a value of the wrong type.
        """
        unknown = set(sections) - set(self.sections.names())
        if unknown:
            raise ValueError(
                f"--plugin-config names unknown plugin section(s) {sorted(unknown)}; "
                f"declared: {sorted(self.sections.names())}"
            )
        result = {}
        for plugin, schema in self.sections.items():
            values = sections.get(plugin, {})
            if not isinstance(values, dict):
                raise ValueError(f"--plugin-config {plugin!r} must be an object, got {values!r}")
            hints = typing.get_type_hints(schema)
            fields = {f.name: f for f in dataclasses.fields(schema)}
            for key, value in values.items():
                if key not in fields:
                    raise ValueError(
                        f"--plugin-config {plugin}.{key} is not a known key; allowed: "
                        f"{sorted(fields)}"
                    )
                if not _matches(value, hints[key]):
                    raise ValueError(
                        f"--plugin-config {plugin}.{key}={value!r} is invalid; allowed: "
                        f"{_type_name(hints[key])}"
                    )
            try:
                result[plugin] = schema(**values)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"--plugin-config {plugin}: {exc}") from exc
        return result

    def get(self, plugin: str, config: KilnConfig) -> Any:
        """``plugin``'s validated section for ``config`` (its defaults when not given)."""
        schema = self.sections.get(plugin)
        return schema(**config.plugins.sections.get(plugin, {}))

    def describe(self) -> dict[str, list[dict[str, str]]]:
        """Each section's fields with type, default and docstring-free description, for display."""
        out = {}
        for plugin, schema in self.sections.items():
            hints = typing.get_type_hints(schema)
            out[plugin] = [
                {
                    "field": f.name,
                    "type": _type_name(hints[f.name]),
                    "default": repr(_field_default(f)),
                }
                for f in dataclasses.fields(schema)
            ]
        return out


PLUGIN_CONFIG_REGISTRY = PluginConfigRegistry()
