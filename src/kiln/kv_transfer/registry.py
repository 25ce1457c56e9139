"""The KV-connector registry: connector name -> dotted class path, which general plugins fill.

``KV_CONNECTOR_REGISTRY.register("MyConnector", "pkg.mod.MyConnector")`` in a general plugin's
``register()`` (``override=True`` to replace one of Kiln's); ``--kv-transfer-config
'{"kv_connector": "MyConnector"}'`` picks it. ``kiln plugins`` lists the entries and who
registered them.
"""

from __future__ import annotations

import importlib

from kiln.config import KilnConfig
from kiln.kv_transfer.base import KVConnectorBase, KVConnectorRole, NoConnector
from kiln.plugins.registry import Registry
from kiln.utils import resolve_obj_by_qualname

_BUILTIN_CONNECTORS = {
    "OffloadingConnector": "kiln.kv_transfer.offloading.OffloadingConnector",
    "P2pConnector": "kiln.kv_transfer.p2p.P2pConnector",
}
KV_CONNECTOR_REGISTRY: Registry[str] = Registry("kv connector", builtins=_BUILTIN_CONNECTORS)


def connector_class(config: KilnConfig) -> type[KVConnectorBase]:
    """The class ``config.kv_transfer`` names (``NoConnector`` for none).

    Raises:
        ValueError: an unknown name (lists the registered ones), a class that is no
            ``KVConnectorBase``, or a combination the engine cannot run (names the field).
    """
    kv = config.kv_transfer
    if kv.kv_connector is None:
        return NoConnector
    if kv.kv_connector_module_path is not None:
        cls = getattr(importlib.import_module(kv.kv_connector_module_path), kv.kv_connector, None)
        where = f"module {kv.kv_connector_module_path!r}"
    elif kv.kv_connector in KV_CONNECTOR_REGISTRY:
        cls = resolve_obj_by_qualname(KV_CONNECTOR_REGISTRY.get(kv.kv_connector))
        where = "the connector registry"
    else:
        raise ValueError(
            f"kv_transfer.kv_connector={kv.kv_connector!r} is invalid; allowed: one of "
            f"{sorted(KV_CONNECTOR_REGISTRY.names())} or a class in kv_connector_module_path"
        )
    if not (isinstance(cls, type) and issubclass(cls, KVConnectorBase)):
        raise ValueError(
            f"kv_transfer.kv_connector={kv.kv_connector!r} in {where} is {cls!r}, not a "
            "subclass of kiln.kv_transfer.KVConnectorBase"
        )
    if config.parallel.pipeline_parallel_size > 1:
        raise ValueError(
            f"kv_transfer.kv_connector={kv.kv_connector!r} is invalid with "
            f"parallel.pipeline_parallel_size={config.parallel.pipeline_parallel_size}; "
            "allowed: no connector with pipeline parallelism"
        )
    return cls


def create_connector(config: KilnConfig, role: KVConnectorRole) -> KVConnectorBase:
    """The connector ``config.kv_transfer`` names, built for ``role`` (see ``connector_class``)."""
    return connector_class(config)(config, role)


__all__ = ["KV_CONNECTOR_REGISTRY", "connector_class", "create_connector"]
