"""Dense bfloat16 linears: kiln-x86's own AVX512-BF16 kernel (else oneDNN's product) on a weight
packed once, eager and in a traced graph.

Contract: ``register_dense_ops()`` registers ``linear`` and ``logits_processor`` implementations
(provider ``kiln_x86_dense``) for layers with a dense bfloat16 weight (``UnquantizedLinearMethod``;
an LM head without a quantized method), not batch-invariant, and 2-d bfloat16 CPU rows:
``[T, in] -> [T, out]``, ``x @ weight.T + bias`` (the head's then cut to the vocabulary, in
float32, times its scale):

- where the CPU has AVX512-BF16 but no AMX and the kernel builds (``csrc/x86_dense.cpp``), its
  product on the weight packed once into tiles of 16 output channels (``tiled_weight``), for
  every row count, on the work pool (the model's thread and its helpers,
  ``x86.helper_threads``): each (row, channel) result is one float32 sum over the inputs in
  order, plus the bias, rounded once, so a row's result does not depend on the call's other
  rows or on the threads (a prefix-cache hit's short prefill and the whole prompt agree bit for
  bit). Measured on an AMD EPYC with AVX512-BF16, 2 cores, against oneDNN on the same 2 cores:
  1.2-3.0x at 1 row, 1.1-1.6x at 16, within 3% from 512 (docs/x86/results.md, "Dense bfloat16
  kernel");
- elsewhere (no AVX512-BF16, AMX, an odd input size) ``torch.ops.mkldnn._linear_pointwise`` on the
  weight reordered once into oneDNN's blocked layout. Where oneDNN has no bfloat16 nothing is
  registered.

In a trace (``kiln_x86.graph``) each call is one dispatcher op: the kernel's
``torch.ops.kiln_x86_dense_bf16.linear(x, tiled, bias, n)``, with the tiled weight as the
graph's constant, replayed without a return to Python; or, for oneDNN, ``torch.ops.kiln_x86_dense
.linear(x, weight, bias)`` on the plain weight, whose kernel finds the packed copy on it (the
packed weight is an opaque oneDNN tensor without storage, which ``torch.jit.trace`` cannot hold
as a constant: "Unsupported value kind: Tensor" at start-up with a bf16 Hugging Face folder).
Not under ``torch.compile``: inductor packs weights itself (freezing).

Side effects: the packed copy (tiled, or oneDNN's) is made on a weight's first call and kept on
the weight tensor itself (``weight.__dict__``, which torch keeps with the tensor), outside
``state_dict()``; it costs a second copy of each dense weight, and is rebuilt at an eager call if
the weight's storage changes (a traced graph keeps the tiles it was traced with, as it keeps
every other constant). Nothing is global: the copy lives and dies with its weight.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kiln.plugin_api import UnquantizedLinearMethod, cpu_flags, register_impl
from kiln_x86 import kernels

SOURCE = Path(__file__).parent / "csrc" / "x86_dense.cpp"
TILE = 16
PROVIDER = "kiln_x86_dense"
PRIORITY = 20
"""Above the reference cpu platform's oneDNN linear (10), which a trace cannot record."""

_PACKED_ATTR = "_kiln_x86_packed"
_TILED_ATTR = "_kiln_x86_tiled"
_BIAS_ATTR = "_kiln_x86_tiled_bias"
_LIBRARY: torch.library.Library | None = None


def load_dense_kernels() -> Any:
    """The compiled ``csrc/x86_dense.cpp`` (built into the cache on first use), or None where it
    cannot be built; its ``linear`` exists only where the CPU has AVX512-BF16."""
    return kernels.load_extension("kiln_x86_dense", SOURCE)


@functools.cache
def _kernel() -> Any:
    """The kernel as a dispatcher op (``torch.ops.kiln_x86_dense_bf16.linear``, which a trace
    records), or None; looked up once: every dense call asks. None where the CPU has AMX-BF16:
    oneDNN multiplies with AMX tiles there, far above this kernel's AVX512-BF16 rate in prefill,
    and the kernel has not been measured against it."""
    if "amx_bf16" in cpu_flags():
        return None
    ext = load_dense_kernels()
    return torch.ops.kiln_x86_dense_bf16.linear if hasattr(ext, "linear") else None


def kernel_available() -> bool:
    """Whether kiln-x86's dense bf16 kernel runs here (built, with AVX512-BF16)."""
    return _kernel() is not None


def tiled_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight [out, in]`` (``in`` even) as ``[ceil(out / 16), in / 2, 32]``: per tile of 16
    output channels, per input pair ``p``, element ``2 c + t`` = channel ``c``, input ``2 p + t``
    (zero channels pad the last tile). Made once and kept on ``weight``."""
    return _cached(weight, _TILED_ATTR, _tile)


def _tile(weight: torch.Tensor) -> torch.Tensor:
    out, k = weight.shape
    tiles = -(-out // TILE)
    padded = F.pad(weight.detach(), (0, 0, 0, tiles * TILE - out))
    return padded.view(tiles, TILE, k // 2, 2).permute(0, 2, 1, 3).reshape(tiles, k // 2, 32)


def tiled_bias(bias: torch.Tensor) -> torch.Tensor:
    """``bias [out]`` in float32, zero-padded to whole tiles; made once and kept on ``bias``."""

    def pad(b: torch.Tensor) -> torch.Tensor:
        return F.pad(b.detach().float(), (0, -(-b.shape[0] // TILE) * TILE - b.shape[0]))

    return _cached(bias, _BIAS_ATTR, pad)


def _cached(tensor: torch.Tensor, attr: str, make: Any) -> torch.Tensor:
    cached = tensor.__dict__.get(attr)
    # Inference tensors keep no version counter: new storage means new weights.
    if cached is None or cached[0] != tensor.data_ptr():
        cached = (tensor.data_ptr(), make(tensor).contiguous())
        tensor.__dict__[attr] = cached
    return cached[1]


def onednn_bf16_available() -> bool:
    """Whether oneDNN multiplies bfloat16 here."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight [out, in]`` in oneDNN's blocked layout, made once and kept on ``weight``."""
    return _cached(
        weight, _PACKED_ATTR, lambda w: torch.ops.mkldnn._reorder_linear_weight(w.detach(), 1)
    )


def _product(x: torch.Tensor, weight: torch.Tensor, bias: Any) -> torch.Tensor:
    """``x @ weight.T + bias``: the kernel where it runs (in a trace, recorded with the tiled
    weight as the graph's constant), else oneDNN (in a trace, the op on the plain weight)."""
    kernel = _kernel()
    if kernel is not None and weight.shape[1] % 2 == 0:
        b = None if bias is None else tiled_bias(bias)
        return kernel(x.contiguous(), tiled_weight(weight), b, weight.shape[0])
    if torch.jit.is_tracing():
        return torch.ops.kiln_x86_dense.linear(x, weight, bias)
    return _onednn_linear(x, weight, bias)


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: Any) -> torch.Tensor:
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


def _logits_supports(op: Any, lm_head: Any, hidden_states: torch.Tensor) -> bool:
    weight = getattr(lm_head, "weight", None)
    return (
        not op.batch_invariant
        and getattr(lm_head, "quant_method", None) is None
        and hidden_states.dtype == torch.bfloat16
        and hidden_states.dim() == 2
        and hidden_states.is_cpu
        and isinstance(weight, torch.Tensor)
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and not torch.compiler.is_compiling()
    )


def logits(op: Any, lm_head: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    """``logits_processor`` op of a dense bf16 LM head: ``[N, hidden] -> [N, vocab_size]``
    float32 (the head's product rounded to bf16, as the reference's ``F.linear``)."""
    out = _product(hidden_states, lm_head.weight, lm_head.bias)[..., : op.vocab_size].float()
    if op.scale != 1.0:
        out.mul_(op.scale)
    return out


def linear(op: Any, x: torch.Tensor) -> torch.Tensor:
    """``linear`` op of a dense bf16 layer: ``[T, in] -> [T, out]``."""
    return _product(x, op.weight, op.bias)


def _define_library() -> None:
    """``torch.ops.kiln_x86_dense.linear``, once per process."""
    global _LIBRARY
    if _LIBRARY is not None:
        return
    library = torch.library.Library("kiln_x86_dense", "DEF")
    library.define("linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
    library.impl("linear", _onednn_linear, "CPU")

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
    register_impl(
        "logits_processor",
        PROVIDER,
        device_type="cpu",
        priority=PRIORITY,
        supports=_logits_supports,
    )(logits)
    return True


__all__ = [
    "PROVIDER",
    "kernel_available",
    "linear",
    "logits",
    "load_dense_kernels",
    "onednn_bf16_available",
    "packed_weight",
    "register_dense_ops",
    "tiled_bias",
    "tiled_weight",
]
