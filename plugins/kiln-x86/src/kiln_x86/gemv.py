"""GGUF weights in a tiled layout for the int8-activation matmul (``csrc/x86_gemv.cpp``).

Contract:

- ``available()``: whether the kernel is built here (a C++ compiler and AVX512-VNNI, or AVX2 with
  FMA and F16C: the same results bit for bit, chosen at compile time); where it is not, nothing
  of this module runs (``kiln_x86.quant`` keeps its row layout).
- ``pack(u, scales, mins, qtype)``: one weight's unsigned integers ``u [out, in]`` (``w = scale *
  (u - offset) + min``, ``offset`` fixed per format), ``scales [out, in / group]`` and ``mins
  [out, in / 32]`` (or None) -> ``TiledWeight``: output channels in tiles of 16, each tile one
  stream of 32-input blocks (weights 16 channels x 4 inputs per 64 bytes, then the tile's 16
  scales and mins). See the C++ file for the byte layout.
- ``matmul(x, tiled)``: ``x [rows, in]`` float32 or bfloat16 -> ``[rows, out]`` in x's dtype,
  with x rounded to int8 per block of 32 (llama.cpp's Q8 activations; not exact: each activation
  moves by at most half its block's step, ``max|x| / 254``), for any number of rows: up to
  ``AMX_MIN_ROWS - 1`` rows the int8 kernel (``gemv``: AVX512-VNNI, or AVX2), from
  ``AMX_MIN_ROWS`` the AMX kernel (``gemm_amx``) where the CPU and Linux allow tiles, else
  ``gemv`` for all rows
  (one parallel region over chunks of 64 rows x tiles of 16 channels). Every path computes a
  (row, channel) result with the same integer sums and the same float operations in the same
  order, so a row's result does not depend on the call's other rows, on the path or on the
  thread count, bit for bit (a prefix-cache hit's short prefill, a decode and a whole prompt's
  prefill agree).
- ``rows(tiled, ids, dtype)``: the weight's rows ``ids``, ``gguf.quants.dequantize``'s values
  exactly in float32 (embedding lookups, dense fallbacks).

Scales and mins are kept in float16 where the format stores them so (Q4_0, Q4_1, Q8_0: exact,
and exactly the GGUF bytes), in float32 for the K-quants (``d * sub-block scale`` needs up to
18 significant bits): Q4_K 1.33x, Q5_K 1.27x, Q6_K 1.22x their GGUF bytes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType

from kiln.plugin_api import cpu_flags, is_capturing
from kiln_x86 import kernels

SOURCE = Path(__file__).parent / "csrc" / "x86_gemv.cpp"
TILE = 16
BLOCK = 32
AMX_MIN_ROWS = 65
"""Rows from which ``matmul`` runs the AMX kernel (where it may): the VNNI kernel's rows stay as
they were measured for decode; the results are the same either way."""


@dataclass(frozen=True)
class Format:
    bits: int
    """Bits of ``u``: 4 (nibbles), 5 or 6 (nibbles and bit planes), 8 (bytes)."""
    group: int
    """Inputs per scale: 32, or 16 (Q6_K)."""
    has_mins: bool
    f16_scales: bool
    offset: int
    """``w = scale * (u - offset) + min``."""


Q = GGMLQuantizationType
FORMATS = {
    Q.Q4_0: Format(4, 32, False, True, 8),
    Q.Q4_1: Format(4, 32, True, True, 0),
    Q.Q8_0: Format(8, 32, False, True, 128),
    Q.Q4_K: Format(4, 32, True, False, 0),
    Q.Q5_K: Format(5, 32, True, False, 0),
    Q.Q6_K: Format(6, 16, False, False, 32),
}


@dataclass(frozen=True)
class TiledWeight:
    """One GGUF weight in the tiled layout (``data``: uint8 ``[tiles, in / 32, record bytes]``)."""

    qtype: GGMLQuantizationType
    out_features: int
    in_features: int
    data: torch.Tensor

    @property
    def format(self) -> Format:
        return FORMATS[self.qtype]

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def args(self) -> tuple[int, int, int, bool, bool, int]:
        """The kernels' layout arguments after ``data``: N, bits, group, mins, f16, offset."""
        f = self.format
        return (self.out_features, f.bits, f.group, f.has_mins, f.f16_scales, f.offset)


@functools.cache
def build_flags() -> list[str]:
    # The build's name hashes its flags: naming VNNI keeps an AVX-512 CPU without it (whose
    # -march=native build has the AVX2 kernel) from sharing a cached build with one that has it.
    # Cached: matmul asks for the extension on every call.
    flags = cpu_flags()
    vnni, amx = "avx512_vnni" in flags, "amx_int8" in flags and "amx_tile" in flags
    return [*kernels.CFLAGS, f"-DKILN_X86_CPU_VNNI={int(vnni)}", f"-DKILN_X86_CPU_AMX={int(amx)}"]


def extension() -> Any:
    """The compiled ``x86_gemv`` extension itself (built on first use), or None: the module
    whose work pool the other kernels attach to."""
    return kernels.load_extension("kiln_x86_gemv", SOURCE, build_flags())


def load_gemv_kernels() -> Any:
    """The compiled ``x86_gemv`` extension (``gemv`` only where built with AVX512-VNNI or AVX2),
    or None (logged once) where it cannot be built. In a graph being captured
    (``is_capturing()``) the same functions as ``torch.ops.kiln_x86_gemv`` ops, traced opaque
    (loaded eagerly before: model loading)."""
    if is_capturing():
        return _TRACED
    ext = extension()
    if ext is not None and not _TRACED.__dict__:
        _register_traced()
    return ext


_TRACED = SimpleNamespace()


def _register_traced() -> None:
    ops = torch.ops.kiln_x86_gemv

    def gemv_fake(x, data, n, bits, group, mins, f16, offset):
        return x.new_empty(x.shape[0], n)

    def dequantize_fake(data, ids, n, k, bits, group, mins, f16, offset, dtype):
        return data.new_empty(ids.numel(), k, dtype=dtype)

    fakes = (("gemv", gemv_fake), ("gemm_amx", gemv_fake), ("dequantize", dequantize_fake))
    for name, fake in fakes:
        if not hasattr(ops, name):
            continue  # gemv is built only with AVX512-VNNI or AVX2, gemm_amx with AMX-INT8 too
        try:
            torch.library.register_fake(f"kiln_x86_gemv::{name}")(fake)
        except RuntimeError:
            pass  # registered by an earlier call in this process
        setattr(_TRACED, name, getattr(ops, name))


def available() -> bool:
    """Whether the tiled int8 kernel runs here (compiled, with AVX512-VNNI or AVX2)."""
    ext = load_gemv_kernels()
    return ext is not None and hasattr(ext, "gemv")


@functools.cache
def amx_available() -> bool:
    """Whether the AMX kernel runs here: built with AMX-INT8, and Linux lets this process use
    tiles (asked once per process)."""
    ext = load_gemv_kernels()
    return ext is not None and hasattr(ext, "gemm_amx") and bool(ext.amx_ready())


def pack(
    u: np.ndarray, scales: np.ndarray, mins: np.ndarray | None, qtype: GGMLQuantizationType
) -> TiledWeight:
    """The tiled layout of one weight (see the module doc); ``u`` integers in ``[0, 2**bits)``."""
    f = FORMATS[qtype]
    n, k = u.shape
    tiles, nb = -(-n // TILE), k // BLOCK
    pad = tiles * TILE - n

    def by_tile(a: np.ndarray) -> np.ndarray:  # [n, ...] -> [tiles, 16, ...], zero rows added
        a = np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)]) if pad else a
        return a.reshape(tiles, TILE, *a.shape[1:])

    # [tiles, nb, half h, j, channel c, t]: input 16 h + 4 j + t of channel c in block b.
    v = by_tile(u.astype(np.uint8)).reshape(tiles, TILE, nb, 2, 4, 4).transpose(0, 2, 3, 4, 1, 5)
    if f.bits == 8:
        weights = v.reshape(tiles, nb, 512)
    else:
        nibbles = (v[:, :, 0] & 0x0F) | ((v[:, :, 1] & 0x0F) << 4)  # [tiles, nb, j, c, t]
        parts: list[np.ndarray] = [nibbles.reshape(tiles, nb, 256)]
        if f.bits > 4:
            # [tiles, nb, j, h, plane, 64 bits]: bit 4 c + t of a mask is bit 4 + plane of u.
            shifts = np.arange(4, f.bits, dtype=np.uint8).reshape(1, 1, 1, 1, -1, 1)
            flat = v.transpose(0, 1, 3, 2, 4, 5).reshape(tiles, nb, 4, 2, 1, 64)
            planes = (flat >> shifts) & 1
            masks = np.packbits(planes, axis=-1, bitorder="little")
            parts.append(masks.reshape(tiles, nb, -1))
        weights = np.concatenate(parts, axis=2)
    sdtype = np.float16 if f.f16_scales else np.float32

    def per_block(a: np.ndarray, per: int) -> np.ndarray:  # [n, nb * per] -> [tiles, nb, bytes]
        a = by_tile(a.astype(sdtype).reshape(n, nb, per)).transpose(0, 2, 3, 1)
        return np.ascontiguousarray(a).view(np.uint8).reshape(tiles, nb, -1)

    records = [weights, per_block(scales, BLOCK // f.group)]
    if f.has_mins:
        assert mins is not None
        records.append(per_block(mins, 1))
    data = np.ascontiguousarray(np.concatenate(records, axis=2))
    return TiledWeight(qtype, n, k, torch.from_numpy(data))


def matmul(x: torch.Tensor, tiled: TiledWeight) -> torch.Tensor:
    """``x [rows, in] @ W.T`` with x rounded to int8 per block of 32, any number of rows (see the
    module doc)."""
    ext, rows = load_gemv_kernels(), x.shape[0]
    if rows >= AMX_MIN_ROWS and amx_available():
        return ext.gemm_amx(x, tiled.data, *tiled.args())
    return ext.gemv(x, tiled.data, *tiled.args())


def rows(tiled: TiledWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight's rows ``ids`` (1-d), ``[len(ids), in]`` in float32 or bfloat16."""
    n, bits, group, mins, f16, offset = tiled.args()
    return load_gemv_kernels().dequantize(
        tiled.data, ids, n, tiled.in_features, bits, group, mins, f16, offset, dtype
    )


__all__ = [
    "AMX_MIN_ROWS",
    "FORMATS",
    "TiledWeight",
    "amx_available",
    "available",
    "load_gemv_kernels",
    "matmul",
    "pack",
    "rows",
]
