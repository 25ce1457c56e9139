"""``DeviceConfig`` (the platform and the classes it names) and ``PluginConfig`` (plugins'
settings).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kiln.config.checks import check

AUTO = "auto"
"""A class field left for the platform to fill."""


def parse_graph_capture_sizes(
    value: list[int] | tuple[int, ...] | str | None,
) -> dict[str, tuple[int, ...] | None]:
    """``--graph-capture-sizes``: ``"1,2,4"`` or a list of ints; ``""`` is no sizes.

    Raises:
        ValueError: an entry is not an integer >= 1.
    """
    if value is None:
        return {"graph_capture_sizes": None}
    items = [p.strip() for p in value.split(",") if p.strip()] if isinstance(value, str) else value
    sizes = []
    for item in items:
        size = int(item) if isinstance(item, int) or str(item).isdigit() else 0
        if size < 1:
            raise ValueError(
                f"graph_capture_sizes={value!r} is invalid; allowed: batch sizes >= 1 like "
                "'1,2,4,8' or [1, 2, 4, 8], or '' for none"
            )
        sizes.append(size)
    return {"graph_capture_sizes": tuple(sizes)}


def parse_plugin_config(
    value: str | dict[str, dict[str, Any]] | None,
) -> dict[str, dict[str, dict[str, Any]]]:
    """``--plugin-config``: JSON (or, from Python, a dict) of sections by plugin name.

    Raises:
        ValueError: not JSON, or not an object of objects.
    """
    if not value:
        return {"sections": {}}
    try:
        data = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError as exc:
        raise ValueError(f"--plugin-config is not valid JSON: {exc}") from exc
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise ValueError(
            '--plugin-config must be a JSON object of sections, like \'{"name": {"key": 1}}\''
        )
    return {"sections": data}


@dataclass(frozen=True)
class DeviceConfig:
    """Which platform runs the model, and the classes it names."""

    platform: str | None = None
    """Force a platform by name (also ``KILN_PLATFORM``); None selects by detection."""
    worker_cls: str = AUTO
    """Dotted path of the worker class (filled by the platform)."""
    model_runner_cls: str = AUTO
    """Dotted path of the model runner class (filled by the platform)."""
    scheduler_cls: str = AUTO
    """Dotted path of the scheduler class (filled by the platform; Kiln's by default)."""
    attention_backend: str = AUTO
    """Dotted path of the attention backend class (filled by the platform)."""
    communicator_cls: str = AUTO
    """Dotted path of the device communicator class (filled by the platform)."""
    graph_wrapper_cls: str = AUTO
    """Dotted path of the graph-capture wrapper class (filled by the platform)."""
    proposer_cls: str = AUTO
    """Dotted path of the speculative-decoding proposer class (filled by the platform)."""
    rejection_sampler_cls: str = AUTO
    """Dotted path of the speculative-decoding rejection sampler class (filled by the platform)."""
    graph_capture_sizes: tuple[int, ...] | None = field(
        default=None, metadata={"metavar": "N,N,...", "parse": parse_graph_capture_sizes}
    )
    """Token counts (buckets) the graph wrapper captures at start-up; a step of ``n`` tokens
    (decodes, speculative verifications, a short prompt) is padded to the smallest bucket
    ``>= n``, and larger steps run eagerly. ``None``: the platform's choice, which is none where
    it captures nothing (``supports_graph_capture = False``), else 1, 2, 4, 8, 16, then every 16,
    up to ``max_num_seqs`` (see ``kiln.worker.graph.graph_capture_sizes``, which also drops sizes
    no step reaches and, with speculative decoding, adds the multiples of ``1 + k``); ``()``: no
    capture. As a flag: "1,2,4,8" ("" for none)."""

    def __post_init__(self) -> None:
        sizes = self.graph_capture_sizes
        check(
            sizes is None or all(isinstance(s, int) and s >= 1 for s in sizes),
            "device.graph_capture_sizes",
            sizes,
            "None or a tuple of integers >= 1",
        )


@dataclass(frozen=True)
class PluginConfig:
    """Settings for plugins: raw sections by plugin name, validated against what each declares."""

    sections: dict[str, dict[str, Any]] = field(
        default_factory=dict,
        metadata={"flag": "plugin_config", "metavar": "JSON", "parse": parse_plugin_config},
    )
    """Settings by plugin name, ``{"plugin-name": {"key": 1}}``, as JSON on the command line;
    each plugin declares and validates its own (see ``kiln plugins``)."""
    platform_changes: tuple[tuple[str, Any, Any], ...] = field(
        default=(), metadata={"internal": True}
    )
    """``(field, old, new)`` for every field the platform's ``check_and_update_config`` changed,
    set by the lifecycle's configure phase (not a flag). It travels with the config to the
    engine core and the workers, whose own configure finds the config already updated, so that
    each process's ``kiln plugins`` report lists the changes."""
