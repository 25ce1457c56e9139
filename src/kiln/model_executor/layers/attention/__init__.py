"""Attention: the layer models use, the backend interface, and backend selection.

Models import ``Attention`` from here. Platforms implement ``AttentionBackend`` and name their class
in the config (``attention_backend``); ``resolve_attn_backend`` imports and checks it.
"""

from __future__ import annotations

from kiln.model_executor.layers.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    kv_cache_block_dim,
    validate_attention_backend,
)
from kiln.model_executor.layers.attention.layer import (
    Attention,
    allocate_kv_caches,
    bind_kv_cache,
    get_attention_layers,
)
from kiln.utils import resolve_obj_by_qualname

__all__ = [
    "REFERENCE_BACKEND",
    "Attention",
    "AttentionBackend",
    "AttentionImpl",
    "AttentionMetadataBuilder",
    "CommonAttentionMetadata",
    "allocate_kv_caches",
    "bind_kv_cache",
    "get_attention_layers",
    "get_attn_backend",
    "kv_cache_block_dim",
    "resolve_attn_backend",
    "validate_attention_backend",
]


def resolve_attn_backend(qualname: str) -> type[AttentionBackend]:
    """Import the backend class at ``qualname`` (``"pkg.mod.Cls"``) and check its interface.

    Raises:
        ImportError, AttributeError: the path does not resolve.
        TypeError: the class does not implement ``AttentionBackend``.
    """
    return validate_attention_backend(resolve_obj_by_qualname(qualname))


REFERENCE_BACKEND = "kiln.model_executor.layers.attention.backends.cpu.CPUAttentionBackend"
"""The pure-PyTorch paged backend every platform's backend is checked against."""


def get_attn_backend() -> type[AttentionBackend]:
    """The attention backend the config names (``device.attention_backend``, filled by the
    platform when the process's lifecycle configured it).

    Models are built inside ``kiln.config.set_current_config``; outside it, or with the field
    still ``"auto"`` (a model loaded by hand, outside an engine), the reference backend. This
    never selects a platform.
    """
    from kiln.config import AUTO, get_current_config

    config = get_current_config()
    if config is not None and config.device.attention_backend != AUTO:
        return resolve_attn_backend(config.device.attention_backend)
    return resolve_attn_backend(REFERENCE_BACKEND)
