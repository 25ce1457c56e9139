"""The forward context: per-step state that attention layers read during a model's forward.

The model runner builds the attention metadata once per step and runs the model inside
``with set_forward_context(ForwardContext(attn_metadata=...)):``; each ``Attention`` layer reads
it with ``get_forward_context()`` instead of having it threaded through every model's signature.
The context lives in a ``ContextVar``, so it is scoped to the ``with`` block (and to the thread or
task that entered it); nothing else here is global. Reading it outside a block is an error.

This module knows nothing about backends: ``attn_metadata`` is whatever the active backend's
metadata builder returned.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any


@dataclass
class ForwardContext:
    """What the layers of one forward pass share."""

    attn_metadata: Any
    """The backend's metadata for this step, shared by all layers; ``None`` in a dummy run (no
    KV cache), where attention layers return zeros."""
    num_tokens: int = 0
    """Tokens in the model's input (may exceed the scheduled tokens when the input is padded)."""
    virtual_engine: int = 0
    """Pipeline-parallel virtual engine index; 0 without pipeline parallelism."""
    attention_layers: Mapping[str, Any] | None = None
    """The model's ``Attention`` layers by layer name, set by the model runner: inside a compiled
    graph attention is one opaque op (``kiln::unified_attention``) that finds its layer here."""
    kv_connector: Any = None
    """A KV connector whose layer hooks each attention layer calls around its forward
    (``wait_for_layer_load``, ``save_kv_layer``; ``kiln.kv_transfer``), or None."""


_forward_context: ContextVar[ForwardContext | None] = ContextVar(
    "kiln_forward_context", default=None
)


@contextmanager
def set_forward_context(context: ForwardContext) -> Iterator[ForwardContext]:
    """Make ``context`` the current forward context inside the block; restore the old on exit.

    Blocks nest: the inner context wins and the outer one is back after it.
    """
    token = _forward_context.set(context)
    try:
        yield context
    finally:
        _forward_context.reset(token)


def get_forward_context() -> ForwardContext:
    """The current forward context.

    Raises:
        RuntimeError: called outside ``set_forward_context`` (an attention layer run outside the
            model runner, for instance).
    """
    context = _forward_context.get()
    if context is None:
        raise RuntimeError(
            "no forward context is set: run the model inside "
            "`with set_forward_context(ForwardContext(attn_metadata=...)):`"
        )
    return context


def is_forward_context_available() -> bool:
    """Whether a forward context is set (for code that may also run outside a model step)."""
    return _forward_context.get() is not None
