"""Kiln's configuration: per-domain frozen dataclasses composed into ``KilnConfig``.

Every field has a default and a docstring right under it. Invalid values raise ``ValueError`` that
names the field, the value and what is allowed. Configs are immutable: a change is a new config
made with ``KilnConfig.replace(section__field=value)`` (``config.replace(device__worker_cls=
"pkg.worker.MyWorker")``), which is how a platform's
``check_and_update_config`` hands back what it changed and how Kiln records the difference for
``kiln plugins``.

The engine flags (``kiln serve``, ``LLM``'s keywords) are made from these fields by
``kiln.engine.arg_utils``: name, type, default and the docstring as help. A field's ``metadata``
says only what differs from that: ``choices``, ``aliases`` (``-q``), ``metavar``, ``positional``,
``flag`` (another name), ``parse`` (a converter from the user's form, ``"40%"``, to
``{field: value}`` of the section) and ``set_by`` (no flag of its own: the named flag's ``parse``
sets it), ``internal`` (no flag: Kiln sets it per process, e.g. a worker's rank). The class
fields a platform fills (``kiln.plugins.interfaces.CLASS_FIELDS``) are not
flags.

Each family of sections has its module: ``kiln.config.model``, ``.batching`` (cache and
scheduler), ``.pooler`` (the pooling runner), ``.parallel``, ``.device`` (device and plugins),
``.lora``, ``.structured_outputs``, ``.speculative`` and ``.kv_transfer``. This package composes
them into ``KilnConfig`` and re-exports every public name: import them from ``kiln.config``.

This package knows nothing about platforms or plugins beyond the names of the fields a platform
fills.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kiln.config.batching import CacheConfig, SchedulerConfig, parse_kv_cache_memory
from kiln.config.device import (
    AUTO,
    DeviceConfig,
    PluginConfig,
    parse_graph_capture_sizes,
    parse_plugin_config,
)
from kiln.config.kv_transfer import (
    KV_LOAD_FAILURE_POLICIES,
    KV_ROLES,
    KVTransferConfig,
    parse_kv_transfer_config,
)
from kiln.config.lora import LoRAConfig
from kiln.config.model import DTYPES, QUANTIZATION_METHODS, ModelConfig
from kiln.config.parallel import EXECUTOR_BACKENDS, ParallelConfig
from kiln.config.pooler import POOLING_TYPES, RUNNERS, parse_pooler_config
from kiln.config.speculative import (
    MAX_NUM_SPECULATIVE_TOKENS,
    SPECULATIVE_METHODS,
    SpeculativeConfig,
    parse_speculative_config,
)
from kiln.config.structured_outputs import (
    STRUCTURED_OUTPUT_BACKENDS,
    StructuredOutputsConfig,
    parse_structured_outputs_config,
)


@dataclass(frozen=True)
class KilnConfig:
    """Everything one engine needs, by domain."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    plugins: PluginConfig = field(default_factory=PluginConfig)
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)

    def __post_init__(self) -> None:
        if self.model.runner == "pooling" and self.speculative.method is not None:
            raise ValueError(
                f"speculative.method={self.speculative.method!r} is invalid with model.runner="
                "'pooling': a pooling request never decodes; allowed: None (no "
                "--speculative-config with --runner pooling)"
            )

    def replace(self, **changes: Any) -> KilnConfig:
        """A copy with fields changed, named ``section__field`` (``device__worker_cls="x.Y"``).

        Raises:
            ValueError: an unknown section or field (names the allowed ones), or an invalid value.
        """
        by_section: dict[str, dict[str, Any]] = {}
        for key, value in changes.items():
            section, sep, name = key.partition("__")
            if not sep or section not in SECTIONS:
                raise ValueError(
                    f"{key!r} is not a config field; use section__field with a section in "
                    f"{list(SECTIONS)}"
                )
            allowed = [f.name for f in dataclasses.fields(SECTIONS[section])]
            if name not in allowed:
                raise ValueError(f"{section}.{name} is not a config field; allowed: {allowed}")
            by_section.setdefault(section, {})[name] = value
        return dataclasses.replace(
            self,
            **{
                section: dataclasses.replace(getattr(self, section), **values)
                for section, values in by_section.items()
            },
        )

    def flat(self) -> dict[str, Any]:
        """Every field as ``{"section.field": value}``."""
        return {
            f"{section}.{f.name}": getattr(getattr(self, section), f.name)
            for section in SECTIONS
            for f in dataclasses.fields(SECTIONS[section])
        }

    def diff(self, other: KilnConfig) -> list[tuple[str, Any, Any]]:
        """``[(field, old, new)]`` for every field that differs from ``self`` in ``other``."""
        mine, theirs = self.flat(), other.flat()
        return [(key, mine[key], theirs[key]) for key in mine if mine[key] != theirs[key]]


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "parallel": ParallelConfig,
    "device": DeviceConfig,
    "lora": LoRAConfig,
    "plugins": PluginConfig,
    "structured_outputs": StructuredOutputsConfig,
    "speculative": SpeculativeConfig,
    "kv_transfer": KVTransferConfig,
}
"""``KilnConfig``'s sections by name, in order."""


_current_config: contextvars.ContextVar[KilnConfig | None] = contextvars.ContextVar(
    "kiln_current_config", default=None
)


@contextlib.contextmanager
def set_current_config(config: KilnConfig) -> Iterator[KilnConfig]:
    """Make ``config`` readable with ``get_current_config()`` inside the block.

    The model runner builds the model inside it, so layers (attention picks its backend from
    ``device.attention_backend``) can read the config without it threading through every model's
    constructor.
    """
    token = _current_config.set(config)
    try:
        yield config
    finally:
        _current_config.reset(token)


def get_current_config() -> KilnConfig | None:
    """The config set by the enclosing ``set_current_config`` block, or None outside one."""
    return _current_config.get()


__all__ = [
    "AUTO",
    "DTYPES",
    "EXECUTOR_BACKENDS",
    "KV_LOAD_FAILURE_POLICIES",
    "KV_ROLES",
    "MAX_NUM_SPECULATIVE_TOKENS",
    "POOLING_TYPES",
    "QUANTIZATION_METHODS",
    "RUNNERS",
    "SECTIONS",
    "SPECULATIVE_METHODS",
    "STRUCTURED_OUTPUT_BACKENDS",
    "CacheConfig",
    "DeviceConfig",
    "KVTransferConfig",
    "KilnConfig",
    "LoRAConfig",
    "ModelConfig",
    "ParallelConfig",
    "PluginConfig",
    "SchedulerConfig",
    "SpeculativeConfig",
    "StructuredOutputsConfig",
    "get_current_config",
    "parse_graph_capture_sizes",
    "parse_kv_cache_memory",
    "parse_kv_transfer_config",
    "parse_plugin_config",
    "parse_pooler_config",
    "parse_speculative_config",
    "parse_structured_outputs_config",
    "set_current_config",
]
