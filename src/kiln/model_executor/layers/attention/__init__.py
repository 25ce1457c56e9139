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
    validate_attention_backend,
)
from kiln.model_executor.layers.attention.layer import (
    Attention,
    bind_kv_cache,
    get_attention_layers,
)
from kiln.utils import resolve_obj_by_qualname

__all__ = [
    "Attention",
    "AttentionBackend",
    "AttentionImpl",
    "AttentionMetadataBuilder",
    "CommonAttentionMetadata",
    "bind_kv_cache",
    "get_attention_layers",
    "get_attn_backend",
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


def get_attn_backend() -> type[AttentionBackend]:
    """The attention backend of the current platform.

    TODO(#3): return ``resolve_attn_backend(config.attention_backend)`` once the config and
    ``kiln.platforms.current_platform`` exist (the platform fills ``attention_backend`` in
    ``check_and_update_config``). Until then this is always the CPU backend.
    """
    from kiln.model_executor.layers.attention.backends.cpu import CPUAttentionBackend

    return CPUAttentionBackend
