"""The ``Attention`` layer that models use, and the helpers that bind KV caches to it.

A model builds one ``Attention`` per transformer layer with its head counts, scale and a unique
``prefix`` (its layer name, e.g. ``"model.layers.0.self_attn.attn"``). The layer never sees the
batch layout: in ``forward`` it takes the step's metadata from the forward context and its own KV
cache from ``self.kv_cache``, which the model runner binds once, after allocating the caches
(``bind_kv_cache``), and hands both to the backend's ``AttentionImpl``.

The layer knows nothing about the kernels; the backend class comes from the caller or from
``get_attn_backend()`` (the platform's choice).

Under ``torch.compile`` or ``torch.jit.trace`` (a platform's graph wrapper, ``kiln.worker.graph``)
the layer is one opaque op, ``torch.ops.kiln.unified_attention(query, key, value, layer_name)``:
its metadata changes every step, so the graph must not record what is inside. The op runs the
layer eagerly at run time, finding it by name in the forward context's ``attention_layers`` (a
name, not the object, so a compiled graph is the same in every process and the on-disk compile
cache can reuse it). It is a plain ``torch.library`` op with a Python kernel, not a
``torch.library.custom_op``, whose wrapper costs more per call and imports dynamo (seconds) on
the first one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from kiln.forward_context import get_forward_context
from kiln.model_executor.custom_op import is_capturing
from kiln.model_executor.layers.attention.backend import AttentionBackend


class Attention(nn.Module):
    """Paged, causal, grouped-query attention over one layer's KV cache.

    Args:
        num_heads: query heads.
        head_size: dimension of each head.
        scale: multiplier of ``q @ k^T``.
        num_kv_heads: key/value heads (default: ``num_heads``); must divide ``num_heads``.
        prefix: the layer name, unique in the model; KV caches are bound by it.
        sliding_window: attend only to the last ``sliding_window`` positions, or ``None``.
        logits_soft_cap: cap the scaled scores at ``cap * tanh(s / cap)`` (Gemma 2), or ``None``.
        backend: the backend class; default: ``get_attn_backend()``.

    Raises:
        ValueError: a head count is not positive, ``num_kv_heads`` does not divide ``num_heads``,
            or ``logits_soft_cap`` is not positive.
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        *,
        prefix: str = "",
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        backend: type[AttentionBackend] | None = None,
    ) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads < 1 or num_kv_heads < 1 or head_size < 1:
            raise ValueError(
                f"num_heads ({num_heads}), num_kv_heads ({num_kv_heads}) and head_size "
                f"({head_size}) must be >= 1"
            )
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        if logits_soft_cap is not None and not logits_soft_cap > 0:
            raise ValueError(f"logits_soft_cap must be > 0 or None, got {logits_soft_cap}")
        if backend is None:
            # Imported here: the package __init__ imports this module.
            from kiln.model_executor.layers.attention import get_attn_backend

            backend = get_attn_backend()
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.layer_name = prefix
        self.backend = backend
        self.impl = backend.get_impl_cls()(
            num_heads,
            head_size,
            scale,
            num_kv_heads,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
        )
        # Bound by the model runner after allocation (bind_kv_cache); a plain attribute, not a
        # buffer, so it stays out of state_dict() and .to().
        self.kv_cache: torch.Tensor | None = None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Attend the step's tokens; see ``AttentionImpl.forward``.

        Args:
            query: [num_tokens, num_heads * head_size] (or [num_tokens, num_heads, head_size]).
            key: [num_tokens, num_kv_heads * head_size] (or 3-D).
            value: like ``key``.

        Returns:
            [num_tokens, num_heads * head_size]; zeros in a dummy run (no attention metadata).

        Raises:
            RuntimeError: outside a forward context, or no KV cache is bound to this layer.
        """
        if is_capturing():
            return torch.ops.kiln.unified_attention(query, key, value, self.layer_name)
        context = get_forward_context()
        num_tokens = query.shape[0]
        if context.attn_metadata is None:
            return query.new_zeros(num_tokens, self.num_heads * self.head_size)
        if self.kv_cache is None:
            raise RuntimeError(
                f"attention layer {self.layer_name!r} has no KV cache bound; "
                "the model runner must call bind_kv_cache() after allocating the caches"
            )
        query = query.view(num_tokens, self.num_heads, self.head_size)
        key = key.view(num_tokens, self.num_kv_heads, self.head_size)
        value = value.view(num_tokens, self.num_kv_heads, self.head_size)
        connector = context.kv_connector
        if connector is not None:
            connector.wait_for_layer_load(self.layer_name)
        output = self.impl.forward(self, query, key, value, self.kv_cache, context.attn_metadata)
        if connector is not None:
            connector.save_kv_layer(self.layer_name, self.kv_cache, context.attn_metadata)
        return output

    def extra_repr(self) -> str:
        return (
            f"name={self.layer_name!r}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, head_size={self.head_size}, "
            f"backend={self.backend.get_name()}"
        )


_LIBRARY = torch.library.Library("kiln", "FRAGMENT")
_LIBRARY.define(
    "unified_attention(Tensor query, Tensor key, Tensor value, str layer_name) -> Tensor"
)


def unified_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_name: str
) -> torch.Tensor:
    """``Attention.forward`` of the layer named ``layer_name``, as an op compilers do not enter.

    Raises:
        RuntimeError: the forward context has no ``attention_layers``, or not this layer.

    Side effects:
        writes the step's keys and values into that layer's KV cache (the cache is not an input of
        the compiled graph, so the compiler has nothing to order around the write).
    """
    layers = get_forward_context().attention_layers
    if layers is None or layer_name not in layers:
        raise RuntimeError(
            f"attention layer {layer_name!r} is not in the forward context's attention_layers; "
            "a compiled model must run inside a ForwardContext(attention_layers=...)"
        )
    return layers[layer_name](query, key, value)


_LIBRARY.impl("unified_attention", unified_attention, "CompositeExplicitAutograd")


@torch.library.register_fake("kiln::unified_attention", lib=_LIBRARY)
def _unified_attention_fake(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_name: str
) -> torch.Tensor:
    return query.new_empty(query.shape[0], query[0].numel())  # [num_tokens, num_heads * head_size]


def get_attention_layers(model: nn.Module) -> dict[str, Attention]:
    """The model's ``Attention`` layers by layer name (their ``prefix``), in module order.

    Raises:
        ValueError: two layers share a name.
    """
    layers: dict[str, Attention] = {}
    for module in model.modules():
        if isinstance(module, Attention):
            if module.layer_name in layers:
                raise ValueError(f"two Attention layers are named {module.layer_name!r}")
            layers[module.layer_name] = module
    return layers


def bind_kv_cache(model: nn.Module, kv_caches: Mapping[str, torch.Tensor]) -> None:
    """Set each ``Attention`` layer's ``kv_cache`` to ``kv_caches[layer_name]``.

    Raises:
        ValueError: a layer has no cache or a cache has no layer (the message names them).

    Side effects:
        sets ``layer.kv_cache`` on every attention layer of ``model``.
    """
    layers = get_attention_layers(model)
    missing = sorted(set(layers) - set(kv_caches))
    extra = sorted(set(kv_caches) - set(layers))
    if missing or extra:
        details: list[Any] = []
        if missing:
            details.append(f"layers without a cache: {missing}")
        if extra:
            details.append(f"caches without a layer: {extra}")
        raise ValueError(
            "KV caches do not match the model's attention layers; " + "; ".join(details)
        )
    for name, layer in layers.items():
        layer.kv_cache = kv_caches[name]


def allocate_kv_caches(
    model: nn.Module,
    backend: type[AttentionBackend],
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """A KV cache of ``num_blocks`` blocks for every attention layer of ``model``, in
    ``backend``'s layout (``get_kv_cache_shape``), bound to the layers; returns them by layer name.

    Zeros: backends may read unwritten slots under a mask, which must stay finite. On CPU they
    come from ``calloc`` (``zeroed_cpu``): nothing is written at start-up, and memory is
    committed only where the cache is used.

    Side effects:
        sets ``layer.kv_cache`` on every attention layer of ``model`` (``bind_kv_cache``).
    """
    kv_caches = {}
    for name, layer in get_attention_layers(model).items():
        shape = backend.get_kv_cache_shape(
            num_blocks, block_size, layer.num_kv_heads, layer.head_size
        )
        if torch.device(device).type == "cpu":
            kv_caches[name] = zeroed_cpu(shape, dtype)
        else:
            kv_caches[name] = torch.zeros(shape, dtype=dtype, device=device)
    bind_kv_cache(model, kv_caches)
    return kv_caches


CPU_CACHE_ALIGN = 64
"""Bytes a CPU KV cache's data is aligned to (a cache line, one AVX-512 vector)."""


def zeroed_cpu(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(shape, dtype)`` on CPU from numpy's ``calloc``, whose large blocks are fresh
    zero pages of the kernel: nothing is written (``torch.zeros`` wrote the whole cache, seconds
    for a few GiB at every start) and pages are committed on first use."""
    nbytes = math.prod(shape) * dtype.itemsize
    buffer = np.zeros(nbytes + CPU_CACHE_ALIGN, np.uint8)
    start = -buffer.ctypes.data % CPU_CACHE_ALIGN
    return torch.from_numpy(buffer[start : start + nbytes]).view(dtype).view(shape)
