"""kiln-x86's implementations of Kiln's custom ops, registered for device type ``cpu``.

Contract: each function has the signature and result of the op's ``forward_native``
(``kiln.model_executor.layers``): ``rms_norm(op, x, residual=None)`` -> normed or
``(normed, x + residual)``; ``rotary_embedding(op, positions, query, key)`` -> rotated
``(query, key)``; ``silu_and_mul(op, x)`` -> ``silu(x[..., :d]) * x[..., d:]``. add + RMSNorm and
SiLU-and-mul run the reference's ATen ops in its order (bit-identical results); the rotary kernel
rounds where the reference rounds (float32 to float32 precision, bfloat16 bit for bit in all but
rare last-bit cases). ``linear(op, x)``, for layers whose GGUF weight is one
``kiln_x86.gemv`` tiled weight (``x86_tiled``, set by the int8 linear method): that weight's
int8 product, bit for bit what the method's ``apply`` returns, minus its Python layers. The
conformance kit compares each with ``forward_native``.

``register_x86_ops()`` registers the C++ kernels (``kiln_x86.kernels``) under provider
``kiln_x86``, for float32 and bfloat16 CPU tensors; where they cannot be built nothing is
registered and the reference runs. The ``*_torch`` functions are the torch-only alternatives that
``benchmarks/ops_bench.py`` measured against them (why the C++ kernels won: docs/x86/results.md,
"Fused ops").

Eager calls go straight to the pybind functions (no dispatcher); in a graph being captured
(``is_capturing()``: ``torch.compile`` or ``torch.jit.trace``, ``kiln_x86.graph``) the same
kernels are called as ``torch.ops.kiln_x86.*``, which have fake (meta) implementations so they
trace as opaque nodes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kiln.plugin_api import is_capturing, register_impl
from kiln_x86 import gemv
from kiln_x86.kernels import load_kernels

PROVIDER = "kiln_x86"
PRIORITY = 20
"""Above the reference cpu platform's oneDNN matmuls (10); they are other ops anyway."""

_DTYPES = (torch.float32, torch.bfloat16)
_KERNELS: Any = None
_GEMV: Any = None
"""``kiln_x86.gemv``'s extension where its kernel is built, else None (no ``linear`` op)."""


def _is_cpu(x: torch.Tensor, other: torch.Tensor | None = None) -> bool:
    """Whether ``x`` and ``other`` (if given) are CPU tensors of a dtype the kernels take (called
    on every op call: ``is_cpu``, not ``device.type``, which builds a device object)."""
    if not x.is_cpu or x.dtype not in _DTYPES:
        return False
    return other is None or (other.is_cpu and other.dtype in _DTYPES)


# -- add + RMSNorm ----------------------------------------------------------------------------
def _rms_norm_supports(op: Any, x: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    return (
        _is_cpu(x, residual)
        and op.weight.dtype == x.dtype
        and (residual is None or residual.dtype == x.dtype)
    )


def rms_norm(op: Any, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
    """``rms_norm`` op: [..., hidden] (+ residual) -> normed, or ``(normed, x + residual)``."""
    if is_capturing():
        outs = torch.ops.kiln_x86.rms_norm(x, residual, op.weight, op.variance_epsilon)
    else:
        outs = _KERNELS.rms_norm(x, residual, op.weight, op.variance_epsilon)
    return outs[0] if residual is None else (outs[0], outs[1])


def rms_norm_torch(op: Any, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
    """Torch-only alternative: the same roundings in three ops instead of seven (bf16)."""
    if residual is not None:
        x = residual = x + residual
    normed = F.rms_norm(x.float(), (op.hidden_size,), None, op.variance_epsilon)
    out = normed * op.weight if x.dtype == torch.float32 else op.weight * normed.to(x.dtype)
    return out if residual is None else (out, residual)


# -- rotary embedding -------------------------------------------------------------------------
def _rotary_supports(op: Any, positions: torch.Tensor, query: torch.Tensor, key: Any) -> bool:
    return (
        _is_cpu(query, key)
        and positions.dtype == torch.int64
        and key.dtype == query.dtype == op.cos_sin_cache.dtype
        and query.dim() == 2
        and key.dim() == 2
    )


def rotary_embedding(op: Any, positions: torch.Tensor, query: torch.Tensor, key: Any) -> Any:
    """``rotary_embedding`` op: [T] positions, [T, H * D] query, [T, Hkv * D] key -> rotated."""
    if is_capturing():
        outs = torch.ops.kiln_x86.rotary_embedding(
            positions, query, key, op.cos_sin_cache, op.head_dim
        )
    else:
        outs = _KERNELS.rotary_embedding(positions, query, key, op.cos_sin_cache, op.head_dim)
    return outs[0], outs[1]


def rotary_torch(op: Any, positions: torch.Tensor, query: torch.Tensor, key: Any) -> Any:
    """Torch-only alternative: query and key heads rotated together in one set of ops."""
    num_tokens, d = positions.shape[0], op.head_dim
    heads = torch.cat((query.view(num_tokens, -1, d), key.view(num_tokens, -1, d)), dim=1)
    cos, sin = op.cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
    x1, x2 = heads.chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    q_heads = query.shape[1] // d
    return (
        rotated[:, :q_heads].reshape(num_tokens, -1),
        rotated[:, q_heads:].reshape(num_tokens, -1),
    )


# -- SiLU and mul -----------------------------------------------------------------------------
def _silu_supports(op: Any, x: torch.Tensor) -> bool:
    return _is_cpu(x)


def silu_and_mul(op: Any, x: torch.Tensor) -> torch.Tensor:
    """``silu_and_mul`` op: [..., 2 * d] -> [..., d]."""
    if is_capturing():
        return torch.ops.kiln_x86.silu_and_mul(x)
    return _KERNELS.silu_and_mul(x)


def silu_and_mul_torch(op: Any, x: torch.Tensor) -> torch.Tensor:
    """Torch-only alternative: the reference's two ops are already the shortest torch form."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]).mul_(x[..., d:])


# -- linear: GGUF weights in kiln_x86.gemv's tiled layout ------------------------------------
def _linear_supports(op: Any, x: torch.Tensor) -> bool:
    # ``x86_tiled``: set by the int8 linear method on a layer that is one tiled weight.
    return "x86_tiled" in op.__dict__ and x.dim() == 2 and _is_cpu(x) and not is_capturing()


def linear(op: Any, x: torch.Tensor) -> torch.Tensor:
    """``linear`` op of a tiled GGUF layer, ``[T, in] -> [T, out]``: the product its linear method
    computes (``gemv.matmul``), without the method's layers of Python around each call (a decode
    step makes ~120 of them; a 576 x 576 weight's kernel takes a few microseconds)."""
    tiled = op.x86_tiled
    if x.shape[0] < gemv.AMX_MIN_ROWS:
        out = _GEMV.gemv(x, tiled.data, *tiled.args())
    else:
        out = gemv.matmul(x, tiled)
    return out if op.bias is None else out + op.bias


# -- registration -----------------------------------------------------------------------------
def _register_fakes() -> None:
    """Shapes of the library ops for torch.compile's tracing (once per process)."""

    def rms_norm_fake(x, residual, weight, eps):
        return [torch.empty_like(x)] + ([torch.empty_like(x)] if residual is not None else [])

    def silu_fake(x):
        return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))

    def rotary_fake(positions, query, key, cache, head_dim):
        return [torch.empty_like(query), torch.empty_like(key)]

    for name, fn in (
        ("kiln_x86::rms_norm", rms_norm_fake),
        ("kiln_x86::silu_and_mul", silu_fake),
        ("kiln_x86::rotary_embedding", rotary_fake),
    ):
        try:
            torch.library.register_fake(name)(fn)
        except RuntimeError:
            pass  # registered by an earlier call in this process


def register_x86_ops() -> bool:
    """Register the C++ kernels as the ``kiln_x86`` provider (idempotent). False, with nothing
    registered, when they cannot be built here."""
    global _KERNELS
    kernels = load_kernels()
    if kernels is None:
        return False
    if _KERNELS is None:
        _KERNELS = kernels
        _register_fakes()
    register_impl(
        "rms_norm", PROVIDER, device_type="cpu", priority=PRIORITY, supports=_rms_norm_supports
    )(rms_norm)
    register_impl(
        "rotary_embedding",
        PROVIDER,
        device_type="cpu",
        priority=PRIORITY,
        supports=_rotary_supports,
    )(rotary_embedding)
    register_impl(
        "silu_and_mul", PROVIDER, device_type="cpu", priority=PRIORITY, supports=_silu_supports
    )(silu_and_mul)
    global _GEMV
    _GEMV = gemv.load_gemv_kernels() if gemv.available() else None
    if _GEMV is not None:
        register_impl(
            "linear", PROVIDER, device_type="cpu", priority=PRIORITY, supports=_linear_supports
        )(linear)
    return True


__all__ = [
    "PROVIDER",
    "register_x86_ops",
    "rms_norm",
    "rms_norm_torch",
    "rotary_embedding",
    "rotary_torch",
    "silu_and_mul",
    "silu_and_mul_torch",
]
