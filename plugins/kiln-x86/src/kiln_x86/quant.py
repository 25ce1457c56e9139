"""Weight-only matmul for GGUF quantized weights: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K.

Contract (a quantized linear or embedding layer keeps what ``pack`` returns, never a float copy):

- ``pack(raw, qtype, out_features, in_features) -> PackedWeight``: ``raw`` is one weight's GGUF
  block bytes, ``torch.uint8`` ``[out_features, in_features // block_size * bytes_per_block]``
  (rows are output channels, as ``weight[out, in]``).
- ``matmul(x, packed)``: ``x [..., in_features]`` (float32 or bfloat16) -> ``[..., out_features]``
  in x's dtype, accumulated in float32.
- ``embedding(ids, packed, dtype)``: the rows ``ids`` of the weight, ``[*ids.shape, in_features]``.
- ``dequantize(packed, dtype)``: the whole weight, equal to ``gguf.quants.dequantize`` bit for bit
  in float32.

Every format is repacked on load into one layout (``csrc/x86_quant.cpp``): per group of 32 (Q6_K:
16) weights a float32 scale and, for the formats with an offset, a float32 min, with 4-bit
values kept as nibbles (Q4_0, Q4_1, Q4_K) and 5-, 6- and 8-bit ones as int8 (Q5_K, Q6_K, Q8_0).
Up to ``int8_max_rows`` rows (``matmul``'s argument: 0 unless the linear method enables it), where
the CPU has AVX512-VNNI and the weight has groups of 32 (all but Q6_K), the C++ int8 kernel rounds
each activation row to int8 per block of 32 (a float32 scale per block, as llama.cpp's Q8
activations) and multiplies it with the weight's integers in int32 dot products, then applies the
scales and mins per block in float32: not exact against the dequantized weights (at most half an
int8 step of each activation block per weight).
``pack(..., tiled=True)`` (the linear method with ``int8_activations``, where
``kiln_x86.gemv.available()``) keeps the weight only in ``kiln_x86.gemv``'s tiled layout instead:
``matmul`` then runs its int8 kernels for every row count (``gemv.matmul``: 16 output channels per
``vpdpbusd``, or AVX2's ``vpmaddubsw`` with the same sums, AMX tiles for prefill, same
activation rounding, the same result per row whatever the row count), ``embedding`` and
``dequantize`` read the same tiles.
Otherwise up to ``MAX_KERNEL_ROWS`` rows run the C++ kernel, which reads each weight once and
dequantizes it in registers (decode is bound by reading the weights); more rows dequantize the
weight and run torch's dense GEMM in x's dtype (prefill is bound by the GEMM, and oneDNN's bf16
GEMM is the fastest here). Without a compiler the same layout runs through torch ops (a logged
error, once).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K

from kiln.plugin_api import is_capturing
from kiln_x86 import gemv, kernels
from kiln_x86.gemv import TiledWeight

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "x86_quant.cpp"

SUPPORTED_TYPES = (
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q5_K,
    GGMLQuantizationType.Q6_K,
)

# Rows up to which matmul runs the C++ kernel; above, dequantize + dense GEMM (measured:
# docs/x86/results.md).
MAX_KERNEL_ROWS = 8
# Rows up to which groups of 32 (all but Q6_K) run the row layout's int8 kernel where it is built
# (AVX512-VNNI: activations rounded to int8 per block of 32, integer dot products), when a caller
# asks for it (``matmul``'s ``int8_max_rows``; ``quant_bench.py``). The linear methods do not: a
# prefix-cache hit's short prefill then took that path where the uncached prompt's did not, and
# the default model's greedy answer to the same chat prompt changed (from "Paris").
INT8_ROWS = 16
# Output channels dequantized at a time for the dense GEMM: a few MiB, so that a large weight
# (the 49152-row LM head) is never expanded whole.
DENSE_TILE_ROWS = 4096


@dataclass(frozen=True)
class PackedWeight:
    """One GGUF weight in the kernels' layout: ``w[n, k] = scales[n, k // group] * q[n, k]
    (+ mins[n, k // group])``; 4-bit ``q`` is stored as nibbles and offset by 8 when there are no
    mins (Q4_0)."""

    qtype: GGMLQuantizationType
    out_features: int
    in_features: int
    group: int
    """Weights per scale: 32, or 16 (Q6_K)."""
    bits: int
    """4: ``qweight`` is uint8 ``[out, in // 2]`` (16 bytes per group: element i in the low
    nibble of byte i, element i + 16 in its high one); 8: int8 ``[out, in]``."""
    qweight: torch.Tensor
    scales: torch.Tensor
    """float32 ``[out, in // group]``."""
    mins: torch.Tensor | None
    """float32 ``[out, in // group]``, or None (symmetric formats)."""

    @property
    def nbytes(self) -> int:
        tensors = (self.qweight, self.scales, self.mins)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def load_quant_kernels() -> Any:
    """The compiled ``x86_quant`` extension, or None (logged once) where it cannot be built.

    In a graph being captured (decode buckets, ``kiln_x86.graph``) it is the same functions as
    ``torch.ops.kiln_x86_quant`` ops, which trace as opaque nodes with the fake implementations
    below; the extension must have been loaded eagerly before (model loading does it).
    """
    if is_capturing():
        return _TRACED_KERNELS
    ext = kernels.load_extension("kiln_x86_quant", SOURCE)
    if ext is not None and not _TRACED_KERNELS.__dict__:
        _register_traced_kernels()
    return ext


_TRACED_KERNELS = SimpleNamespace()
"""``qmatmul``, ``dequantize`` (and ``qmatmul_int8`` where built) as dispatcher ops."""


def _register_traced_kernels() -> None:
    """Fake implementations of the extension's ops (shapes only), once per process."""
    ops = torch.ops.kiln_x86_quant

    def qmatmul_fake(x, qweight, scales, mins, group, bits):
        return x.new_empty(x.shape[0], qweight.shape[0])

    def dequantize_fake(qweight, scales, mins, in_features, group, bits, dtype):
        return qweight.new_empty(qweight.shape[0], in_features, dtype=dtype)

    fakes = {"qmatmul": qmatmul_fake, "dequantize": dequantize_fake, "qmatmul_int8": qmatmul_fake}
    for name, fake in fakes.items():
        if not hasattr(ops, name):
            continue  # qmatmul_int8 is built only where the CPU has AVX512-VNNI
        try:
            torch.library.register_fake(f"kiln_x86_quant::{name}")(fake)
        except RuntimeError:
            pass  # registered by an earlier call in this process
        setattr(_TRACED_KERNELS, name, getattr(ops, name))


def _f16(col: np.ndarray) -> np.ndarray:
    """Little-endian float16 bytes ``[n, 2]`` -> float32 ``[n]``."""
    return np.ascontiguousarray(col).view(np.float16).astype(np.float32).reshape(-1)


def _decode(blocks: np.ndarray, qtype: GGMLQuantizationType):
    """GGUF blocks ``[num_blocks, bytes_per_block]`` -> (q ``[num_blocks, block_size]``, scales
    and mins ``[num_blocks, groups per block]`` float32, mins None where there is no offset),
    with ``scales * q + mins`` exactly gguf's dequantized value."""
    nb = blocks.shape[0]
    if qtype in (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1):
        has_min = qtype == GGMLQuantizationType.Q4_1
        qs = blocks[:, 4 if has_min else 2 :]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1)  # elements 0..15, then 16..31
        mins = _f16(blocks[:, 2:4])[:, None] if has_min else None
        return q, _f16(blocks[:, :2])[:, None], mins
    if qtype == GGMLQuantizationType.Q8_0:
        return blocks[:, 2:].view(np.int8), _f16(blocks[:, :2])[:, None], None
    if qtype in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K):
        d, dmin = _f16(blocks[:, 0:2])[:, None], _f16(blocks[:, 2:4])[:, None]
        sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
        if qtype == GGMLQuantizationType.Q4_K:
            qs, high = blocks[:, 16:], None
        else:
            high, qs = blocks[:, 16:48], blocks[:, 48:]
        # 4 chunks of 32 bytes: sub-block 2j in the low nibbles of chunk j, 2j + 1 in the high.
        qs = qs.reshape(nb, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        q = (qs & 0x0F).reshape(nb, 8, 32)
        if high is not None:  # Q5_K: bit i of byte l is the fifth bit of element l of sub-block i
            bits = high.reshape(nb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
            q = q | ((bits & 1) << 4)
        return q.reshape(nb, 256), d * sc.astype(np.float32), -(dmin * m.astype(np.float32))
    if qtype == GGMLQuantizationType.Q6_K:
        ql, qh = blocks[:, :128], blocks[:, 128:192]
        sc = blocks[:, 192:208].view(np.int8).astype(np.float32)
        d = _f16(blocks[:, 208:210])[:, None]
        low = (ql.reshape(nb, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F
        high = (
            qh.reshape(nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
        ) & 3
        q = (low.reshape(nb, 8, 32) | (high.reshape(nb, 8, 32) << 4)).astype(np.int8) - 32
        return q.reshape(nb, 256), d * sc, None
    raise AssertionError(qtype)


def pack(
    raw: torch.Tensor,
    qtype: GGMLQuantizationType,
    out_features: int,
    in_features: int,
    tiled: bool = False,
) -> PackedWeight | TiledWeight:
    """Repacks one GGUF weight's block bytes for ``matmul``/``embedding`` (see the module doc);
    ``tiled``: into ``kiln_x86.gemv``'s layout for the int8-activation kernel instead.

    Raises:
        ValueError: an unsupported ``qtype``, or ``raw`` not of the shape and dtype that
            ``out_features`` x ``in_features`` of that type need.
    """
    qtype = GGMLQuantizationType(qtype)
    if qtype not in SUPPORTED_TYPES:
        allowed = ", ".join(t.name for t in SUPPORTED_TYPES)
        raise ValueError(f"qtype={qtype.name} is not supported by kiln-x86; allowed: {allowed}")
    block_size, block_bytes = GGML_QUANT_SIZES[qtype]
    if out_features < 1 or in_features < 1 or in_features % block_size:
        raise ValueError(
            f"in_features={in_features} (out_features={out_features}) is invalid for "
            f"{qtype.name}; allowed: a positive multiple of its block size {block_size}"
        )
    row_bytes = in_features // block_size * block_bytes
    if raw.dtype != torch.uint8 or tuple(raw.shape) != (out_features, row_bytes):
        raise ValueError(
            f"raw has dtype {raw.dtype} and shape {tuple(raw.shape)}; allowed: torch.uint8 "
            f"[{out_features}, {row_bytes}] ({qtype.name}, {in_features} inputs per row)"
        )
    blocks = raw.contiguous().numpy().reshape(-1, block_bytes)
    q, scales, mins = _decode(blocks, qtype)
    if tiled:
        offset = gemv.FORMATS[qtype].offset
        if qtype in (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q6_K):  # signed q
            q = q.astype(np.int16) + offset
        u = q.reshape(out_features, in_features)
        mins = None if mins is None else mins.reshape(out_features, -1)
        return gemv.pack(u, scales.reshape(out_features, -1), mins, qtype)
    group = 16 if qtype == GGMLQuantizationType.Q6_K else 32
    bits = (
        4
        if qtype
        in (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_K)
        else 8
    )
    q = q.reshape(out_features, in_features)
    if bits == 4:  # group of 32 -> 16 bytes: element i low nibble, element i + 16 high nibble
        g = q.reshape(out_features, -1, 2, 16).astype(np.uint8)
        qweight = torch.from_numpy(np.ascontiguousarray(g[:, :, 0] | (g[:, :, 1] << 4)))
        qweight = qweight.reshape(out_features, in_features // 2)
    else:
        qweight = torch.from_numpy(np.ascontiguousarray(q.astype(np.int8)))

    def per_group(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).reshape(out_features, -1)

    return PackedWeight(
        qtype=qtype,
        out_features=out_features,
        in_features=in_features,
        group=group,
        bits=bits,
        qweight=qweight,
        scales=per_group(scales),
        mins=None if mins is None else per_group(mins),
    )


def _dequantize_rows(
    packed: PackedWeight, qweight, scales, mins, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Weights of the given packed rows, ``[rows, in_features]`` (C++, else torch ops)."""
    ext = load_quant_kernels()
    if ext is not None and dtype in (torch.float32, torch.bfloat16):
        return ext.dequantize(
            qweight, scales, mins, packed.in_features, packed.group, packed.bits, dtype
        )
    rows = qweight.shape[0]
    if packed.bits == 4:
        g = qweight.reshape(rows, -1, 1, 16)
        q = torch.cat([g & 0x0F, g >> 4], dim=2).reshape(rows, -1, 32).float()
        if mins is None:
            q = q - 8
    else:
        q = qweight.reshape(rows, -1, packed.group).float()
    w = q * scales[:, :, None]
    if mins is not None:
        w = w + mins[:, :, None]
    return w.reshape(rows, packed.in_features).to(dtype)


def dequantize(
    packed: PackedWeight | TiledWeight, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The weight ``[out_features, in_features]`` in ``dtype`` (float32: gguf's values exactly)."""
    if isinstance(packed, TiledWeight):
        return gemv.rows(packed, torch.arange(packed.out_features), dtype)
    return _dequantize_rows(packed, packed.qweight, packed.scales, packed.mins, dtype)


def embedding(
    ids: torch.Tensor, packed: PackedWeight | TiledWeight, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Rows ``ids`` of the weight (a quantized embedding table): ``[*ids.shape, in_features]``."""
    flat = ids.reshape(-1)
    if isinstance(packed, TiledWeight):
        return gemv.rows(packed, flat, dtype).reshape(*ids.shape, packed.in_features)
    mins = None if packed.mins is None else packed.mins.index_select(0, flat)
    qweight, scales = packed.qweight.index_select(0, flat), packed.scales.index_select(0, flat)
    rows = _dequantize_rows(packed, qweight, scales, mins, dtype)
    return rows.reshape(*ids.shape, packed.in_features)


def int8_kernel_applies(
    ext: ModuleType | None, packed: PackedWeight, rows: int, int8_max_rows: int
) -> bool:
    """Whether ``matmul`` of ``rows`` rows rounds the activations to int8 (see the module doc)."""
    return (
        ext is not None
        and hasattr(ext, "qmatmul_int8")
        and packed.group == 32
        and 0 < rows <= int8_max_rows
    )


def matmul(
    x: torch.Tensor, packed: PackedWeight | TiledWeight, int8_max_rows: int = 0
) -> torch.Tensor:
    """``x @ W.T`` for the packed weight W: ``[..., in_features] -> [..., out_features]``; up to
    ``int8_max_rows`` rows with the activations rounded to int8 where the kernel is built (a
    ``TiledWeight``: every row count, whatever ``int8_max_rows``).

    Raises:
        ValueError: x's last dim is not ``in_features``, or x is neither float32 nor bfloat16.
    """
    if x.shape[-1] != packed.in_features:
        raise ValueError(
            f"x has {x.shape[-1]} features in its last dim; allowed: {packed.in_features}"
        )
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"x.dtype={x.dtype} is not supported; allowed: float32, bfloat16")
    x2 = x.reshape(-1, packed.in_features)
    if isinstance(packed, TiledWeight):
        out = gemv.matmul(x2, packed)
        return out.reshape(*x.shape[:-1], packed.out_features)
    ext = load_quant_kernels()
    if int8_kernel_applies(ext, packed, x2.shape[0], int8_max_rows):
        out = ext.qmatmul_int8(
            x2, packed.qweight, packed.scales, packed.mins, packed.group, packed.bits
        )
    elif ext is not None and x2.shape[0] <= MAX_KERNEL_ROWS:
        out = ext.qmatmul(x2, packed.qweight, packed.scales, packed.mins, packed.group, packed.bits)
    elif packed.out_features <= DENSE_TILE_ROWS:
        out = torch.nn.functional.linear(x2, dequantize(packed, x.dtype))
    else:
        out = x2.new_empty(x2.shape[0], packed.out_features)
        for start in range(0, packed.out_features, DENSE_TILE_ROWS):
            rows = slice(start, start + DENSE_TILE_ROWS)
            mins = None if packed.mins is None else packed.mins[rows]
            w = _dequantize_rows(packed, packed.qweight[rows], packed.scales[rows], mins, x.dtype)
            out[:, rows] = torch.nn.functional.linear(x2, w)
    return out.reshape(*x.shape[:-1], packed.out_features)
