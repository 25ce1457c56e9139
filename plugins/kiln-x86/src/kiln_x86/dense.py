"""Dense bfloat16 linears: oneDNN's product on packed weights, eager and in a traced graph.

Contract: ``register_dense_ops()`` registers a ``linear`` implementation (provider
``kiln_x86_dense``) for layers with a dense bfloat16 weight (``UnquantizedLinearMethod``), not
batch-invariant, and 2-d bfloat16 CPU rows: ``[T, in] -> [T, out]``, ``x @ weight.T + bias``,
the products of ``torch.ops.mkldnn._linear_pointwise`` on the weight reordered once into
oneDNN's blocked layout (one decode row here, load 2: 30 / 81 / 52 us against ``F.linear``'s
47 / 148 / 89 us for the default model's 576x576, 3072x576 and 576x1536 weights). Where oneDNN
has no bfloat16 nothing is registered.

Why an op of its own: the packed weight is an opaque oneDNN tensor without storage, which
``torch.jit.trace`` cannot hold as a constant ("Unsupported value kind: Tensor" at start-up with
a bf16 Hugging Face folder). In a trace (``kiln_x86.graph``) each call is recorded as one
``torch.ops.kiln_x86_dense.linear(x, weight, bias)`` on the plain weight, a constant the graph
can keep; its kernel finds the packed copy on that weight. Not under ``torch.compile``: inductor
packs weights itself (freezing).

Side effects: the packed copy is made on a weight's first call and kept on the weight tensor
itself (``weight.__dict__``, which torch keeps with the tensor, so a graph's constant finds it at
replay), outside ``state_dict()``; it costs a second copy of each dense weight, and is rebuilt if
the weight's storage changes. Nothing is global: the copy lives and dies with its weight.
"""

from __future__ import annotations

from typing import Any

import torch

from kiln.plugin_api import UnquantizedLinearMethod, register_impl

PROVIDER = "kiln_x86_dense"
PRIORITY = 20
"""Above the reference cpu platform's oneDNN linear (10), which a trace cannot record."""

_PACKED_ATTR = "_kiln_x86_packed"
_LIBRARY: torch.library.Library | None = None


def onednn_bf16_available() -> bool:
    """Whether oneDNN multiplies bfloat16 here."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight [out, in]`` in oneDNN's blocked layout, made once and kept on ``weight``."""
    cached = weight.__dict__.get(_PACKED_ATTR)
    # Inference tensors keep no version counter: new storage means new weights.
    if cached is None or cached[0] != weight.data_ptr():
        cached = (weight.data_ptr(), torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1))
        weight.__dict__[_PACKED_ATTR] = cached
    return cached[1]


def _packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: Any) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight(weight), bias, "none", [], "")


def _linear_supports(op: Any, x: torch.Tensor) -> bool:
    weight = getattr(op, "weight", None)
    # A batch-invariant layer is the cpu platform's tiled product's, whose rows do not depend on
    # the call's other rows; oneDNN's own blocking here may.
    return (
        not op.batch_invariant
        and type(op.quant_method) is UnquantizedLinearMethod
        and x.dtype == torch.bfloat16
        and x.dim() == 2
        and x.is_cpu
        and isinstance(weight, torch.Tensor)
        and weight.dtype == torch.bfloat16
        and not torch.compiler.is_compiling()
    )


def linear(op: Any, x: torch.Tensor) -> torch.Tensor:
    """``linear`` op of a dense bf16 layer: ``[T, in] -> [T, out]``."""
    if torch.jit.is_tracing():
        return torch.ops.kiln_x86_dense.linear(x, op.weight, op.bias)
    return _packed_linear(x, op.weight, op.bias)


def _define_library() -> None:
    """``torch.ops.kiln_x86_dense.linear``, once per process."""
    global _LIBRARY
    if _LIBRARY is not None:
        return
    library = torch.library.Library("kiln_x86_dense", "DEF")
    library.define("linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
    library.impl("linear", _packed_linear, "CPU")

    def linear_fake(x, weight, bias):
        return x.new_empty(x.shape[0], weight.shape[0])

    torch.library.register_fake("kiln_x86_dense::linear", linear_fake, lib=library)
    _LIBRARY = library


def register_dense_ops() -> bool:
    """Register the dense bf16 ``linear`` (idempotent). False, with nothing registered, where
    oneDNN has no bfloat16."""
    if not onednn_bf16_available():
        return False
    _define_library()
    register_impl(
        "linear", PROVIDER, device_type="cpu", priority=PRIORITY, supports=_linear_supports
    )(linear)
    return True


__all__ = ["PROVIDER", "linear", "onednn_bf16_available", "packed_weight", "register_dense_ops"]
