"""``KVTransferConfig``: a KV connector, which moves KV-cache blocks in and out of the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kiln.config.checks import check, parse_json_fields

KV_ROLES = ("kv_both", "kv_producer", "kv_consumer")
"""Values of ``kv_transfer.kv_role`` (vLLM's): an instance that saves and loads, only saves
(a prefill instance), or only loads (a decode instance)."""

KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")
"""Values of ``kv_transfer.kv_load_failure_policy``."""

OFFLOADING_CONNECTOR = "OffloadingConnector"
"""The connector ``--kv-offloading-size`` selects (``kiln.kv_transfer.offloading``)."""

_EXAMPLE = '\'{"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}\''


def parse_kv_transfer_config(value: str | dict[str, Any] | None) -> dict[str, Any]:
    """``--kv-transfer-config``: JSON (or, from Python, a dict) of ``KVTransferConfig`` fields,
    spelled as vLLM spells them.

    Raises:
        ValueError: not JSON, not an object, or a key that is no field (names the allowed ones).
    """
    if not value:
        return {}
    exclude = ("kv_offloading_size",)  # a flag of its own
    return parse_json_fields(value, "kv_transfer_config", KVTransferConfig, _EXAMPLE, exclude)


def parse_kv_offloading_size(value: float | str | None) -> dict[str, Any]:
    """``--kv-offloading-size GIB``: the CPU tier of the offloading connector (which it selects).

    Raises:
        ValueError: not a number above 0.
    """
    if value is None:
        return {}
    try:
        size = float(value)
    except (TypeError, ValueError):
        size = -1.0
    check(size > 0, "kv_transfer.kv_offloading_size", value, "a size in GiB above 0, like 4")
    return {"kv_offloading_size": size, "kv_connector": OFFLOADING_CONNECTOR}


@dataclass(frozen=True)
class KVTransferConfig:
    """A KV connector (``kiln.kv_transfer``): where blocks come from beyond the local prefix
    cache and where they go.

    Set by ``--kv-transfer-config`` (``LLM(kv_transfer_config={...})``), as vLLM:
    ``'{"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"cpu_bytes":
    4e9}}'``; ``--kv-offloading-size 4`` is the short form of the offloading connector with a
    4 GiB CPU tier."""

    kv_connector: str | None = field(
        default=None,
        metadata={
            "flag": "kv_transfer_config",
            "metavar": "JSON",
            "parse": parse_kv_transfer_config,
        },
    )
    """A KV connector as JSON with vLLM's keys (``kv_connector``, ``kv_role``,
    ``kv_connector_extra_config``, ``kv_connector_module_path``, ``kv_load_failure_policy``):
    ``kv_connector`` is a name in the connector registry (``kiln plugins`` lists them) or a
    class in ``kv_connector_module_path``; None: no connector."""
    kv_role: str = field(default="kv_both", metadata={"set_by": "kv_transfer_config"})
    """``kv_both``, ``kv_producer`` (saves only) or ``kv_consumer`` (loads only)."""
    kv_connector_extra_config: dict[str, Any] = field(
        default_factory=dict, metadata={"set_by": "kv_transfer_config"}
    )
    """The connector's own options (each connector documents its keys)."""
    kv_connector_module_path: str | None = field(
        default=None, metadata={"set_by": "kv_transfer_config"}
    )
    """A module holding the connector class named ``kv_connector`` (a connector outside any
    plugin); None: the registry."""
    kv_load_failure_policy: str = field(
        default="recompute", metadata={"set_by": "kv_transfer_config"}
    )
    """When blocks fail to load: ``recompute`` them (the request goes on, slower) or ``fail``
    the request (finish reason "error")."""
    kv_offloading_size: float | None = field(
        default=None, metadata={"metavar": "GIB", "parse": parse_kv_offloading_size}
    )
    """The offloading connector's CPU tier in GiB (vLLM's ``--kv-offloading-size``); setting it
    selects that connector."""

    def __post_init__(self) -> None:
        check(
            self.kv_connector is None
            or (isinstance(self.kv_connector, str) and bool(self.kv_connector)),
            "kv_transfer.kv_connector",
            self.kv_connector,
            "a connector name (see `kiln plugins`) or None",
        )
        check(
            self.kv_role in KV_ROLES,
            "kv_transfer.kv_role",
            self.kv_role,
            f"one of {list(KV_ROLES)}",
        )
        check(
            self.kv_load_failure_policy in KV_LOAD_FAILURE_POLICIES,
            "kv_transfer.kv_load_failure_policy",
            self.kv_load_failure_policy,
            f"one of {list(KV_LOAD_FAILURE_POLICIES)}",
        )
        check(
            isinstance(self.kv_connector_extra_config, dict),
            "kv_transfer.kv_connector_extra_config",
            self.kv_connector_extra_config,
            "a JSON object",
        )
        check(
            self.kv_offloading_size is None or self.kv_connector == OFFLOADING_CONNECTOR,
            "kv_transfer.kv_offloading_size",
            self.kv_offloading_size,
            f"None unless kv_connector is {OFFLOADING_CONNECTOR!r}",
        )
