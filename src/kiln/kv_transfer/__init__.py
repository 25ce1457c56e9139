"""KV connectors: the third kind of plugin (after platforms and models), as in vLLM.

The contract is ``kiln.kv_transfer.base``; the registry general plugins fill is
``kiln.kv_transfer.registry``; Kiln's own connector is the offloading connector
(``kiln.kv_transfer.offloading``: a CPU tier for blocks that leave the paged cache).
"""

from kiln.kv_transfer.base import STAT_NAMES, KVConnectorBase, KVConnectorRole, NoConnector
from kiln.kv_transfer.registry import KV_CONNECTOR_REGISTRY, connector_class, create_connector

__all__ = [
    "KV_CONNECTOR_REGISTRY",
    "STAT_NAMES",
    "KVConnectorBase",
    "KVConnectorRole",
    "NoConnector",
    "connector_class",
    "create_connector",
]
