"""What the plugins did in this process, as data (``--json``, ``GET /debug/plugins``) and as text.

The report lists every entry point and its status, each platform detector's verdict, the chosen
platform and why, every config field the platform changed, every registry override, every op
implementation, every entry a plugin added to a registry (models, loaders, ops, tool and reasoning
parsers, config sections: each registry alive in the process, whatever its layer), every patch
with its status, and the declared plugin config sections.
"""

from __future__ import annotations

import os
from typing import Any

from kiln.config import KilnConfig
from kiln.model_executor.custom_op import OP_REGISTRY
from kiln.platforms.interface import PLATFORM_API_VERSION
from kiln.plugins.config import PLUGIN_CONFIG_REGISTRY
from kiln.plugins.interfaces import CLASS_FIELDS, resolve_class
from kiln.plugins.manager import PluginManager
from kiln.plugins.registry import describe, registries
from kiln.utils import resolve_obj_by_qualname


def _jsonable(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return repr(value)


def _device_info(platform_cls: Any) -> dict[str, Any]:
    """``Platform.device_info()``, or the error it raised (a report must not fail on it)."""
    try:
        info = platform_cls.device_info()
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    if not isinstance(info, dict):
        return {"error": f"device_info() returned {type(info).__name__}, not a dict"}
    return info


def build_report(
    manager: PluginManager, config: KilnConfig | None, *, check_classes: bool = True
) -> dict[str, Any]:
    """The report as a JSON-ready dict. ``check_classes`` imports each named class and checks it
    against its interface (status ``ok`` or the error)."""
    choice = manager.choice
    platform: dict[str, Any] | None = None
    if choice is not None:
        cls = choice.platform_cls
        platform = {
            "name": choice.name,
            "class": choice.qualname,
            "reason": choice.reason,
            "api_version": cls.api_version,
            "device_type": cls.device_type,
            "dist_backend": cls.dist_backend,
            "supported_dtypes": list(cls.supported_dtypes),
            "supported_quantization": list(cls.supported_quantization),
            "supports_graph_capture": cls.supports_graph_capture,
            "device_info": _device_info(cls),
        }
    classes = []
    if config is not None:
        for field in CLASS_FIELDS:
            qualname = getattr(config.device, field)
            status = "unchecked"
            if check_classes:
                try:
                    resolve_class(field, qualname)
                    status = "ok"
                except Exception as exc:
                    status = f"{type(exc).__name__}: {exc}"
            classes.append({"field": field, "class": qualname, "status": status})
    live = registries()
    overrides = [vars(o) for o in (*(o for r in live for o in r.overrides), *OP_REGISTRY.overrides)]
    op_impls = [
        {
            "op": impl.op,
            "provider": impl.provider,
            "device_type": impl.device_type,
            "priority": impl.priority,
            "function": describe(impl.fn),
            "plugin": impl.source,
        }
        for name in OP_REGISTRY.ops.names()
        for impl in OP_REGISTRY.implementations(name)
    ]
    models = _plugin_models(live) if check_classes else []
    registered = [
        {
            "registry": reg.kind,
            "name": name,
            "value": describe(value),
            "plugin": reg.source_of(name),
        }
        for reg in live
        for name, value in reg.items()
        if reg.source_of(name) != "kiln"
    ]
    return _jsonable(
        {
            "pid": os.getpid(),
            "role": manager.role,
            "core_platform_api_version": PLATFORM_API_VERSION,
            "phases": manager.phases,
            "platform": platform,
            "platform_plugins": [r.as_dict() for r in manager.platform_records],
            "general_plugins": [r.as_dict() for r in manager.general_records],
            "config_changes": [
                {"field": f, "old": old, "new": new} for f, old, new in manager.config_changes
            ],
            "classes": classes,
            "models": models,
            "registry_overrides": overrides,
            "plugin_registrations": registered,
            "op_implementations": op_impls,
            "patches": [p.as_dict() for p in manager.patches.patches.values()],
            "plugin_config": PLUGIN_CONFIG_REGISTRY.describe(),
        }
    )


MODEL_MEMBERS = ("forward", "compute_logits", "load_weights", "attention_layers")
"""What a model class must have (the model contract, ``kiln.model_executor.models.llama``)."""


def check_model_class(qualname: str) -> str:
    """``ok``, or why the model class at ``qualname`` does not meet the model contract (it does
    not import, or lacks a member of ``MODEL_MEMBERS``)."""
    try:
        cls = resolve_obj_by_qualname(qualname)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    missing = [m for m in MODEL_MEMBERS if not callable(getattr(cls, m, None))]
    if missing:
        return f"lacks the model contract's {', '.join(missing)} (needs {', '.join(MODEL_MEMBERS)})"
    return "ok"


def _plugin_models(live: list[Any]) -> list[dict[str, Any]]:
    """The model architectures plugins registered, each checked (``check_model_class``)."""
    return [
        {
            "architecture": name,
            "class": value,
            "plugin": reg.source_of(name),
            "status": check_model_class(value),
        }
        for reg in live
        if reg.kind == "model"
        for name, value in reg.items()
        if reg.source_of(name) != "kiln"
    ]


def _table(title: str, rows: list[dict[str, Any]], columns: list[str]) -> list[str]:
    lines = [f"{title}:"]
    if not rows:
        return [*lines, "  (none)", ""]
    cells = [[str(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    widths = [min(w, 70) for w in widths]
    lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    for r in cells:
        lines.append("  " + "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)))
    return [*lines, ""]


def _cell(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def format_report(report: dict[str, Any]) -> str:
    """The report as readable tables."""
    lines: list[str] = []
    p = report.get("platform")
    if p:
        lines += [
            f"Platform: {p['name']} ({p['class']}, API {p['api_version']}) - {p['reason']}",
            f"  device_type={p['device_type']} dist_backend={p['dist_backend']} "
            f"dtypes={p['supported_dtypes']} quantization={p['supported_quantization']} "
            f"graph_capture={p['supports_graph_capture']}",
        ]
        info = p.get("device_info") or {}
        if info:
            lines.append("  device: " + " ".join(f"{k}={_cell(v)}" for k, v in info.items()))
        lines += [
            "",
        ]
    if report.get("error"):
        lines += [f"ERROR: {report['error']}", ""]
    lines += _table(
        "Platform plugins (kiln.platform_plugins)",
        report["platform_plugins"],
        ["name", "distribution", "status", "detail"],
    )
    lines += _table(
        "General plugins (kiln.general_plugins)",
        report["general_plugins"],
        ["name", "distribution", "status", "detail"],
    )
    lines += _table("Config set by the platform", report["config_changes"], ["field", "old", "new"])
    lines += _table("Classes", report["classes"], ["field", "class", "status"])
    lines += _table(
        "Models from plugins", report["models"], ["architecture", "class", "plugin", "status"]
    )
    lines += _table(
        "Registry overrides",
        report["registry_overrides"],
        ["registry", "name", "old", "new", "source"],
    )
    lines += _table(
        "Registered by plugins",
        report["plugin_registrations"],
        ["registry", "name", "value", "plugin"],
    )
    lines += _table(
        "Op implementations",
        report["op_implementations"],
        ["op", "provider", "device_type", "priority", "plugin"],
    )
    lines += _table("Patches", report["patches"], ["target", "scope", "plugin", "status", "detail"])
    config_rows = [
        {"section": section, **row}
        for section, rows in report["plugin_config"].items()
        for row in rows
    ]
    lines += _table(
        "Plugin config (--plugin-config)", config_rows, ["section", "field", "type", "default"]
    )
    tracebacks = [
        r for r in report["platform_plugins"] + report["general_plugins"] if r.get("traceback")
    ]
    for r in tracebacks:
        lines += [f"Traceback of {r['group']}:{r['name']}:", r["traceback"]]
    return "\n".join(lines).rstrip() + "\n"
