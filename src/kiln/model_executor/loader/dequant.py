"""Dequantization of GGUF tensor data to float32, vectorised over all blocks with numpy.

Contract: ``dequantize(data, qtype)`` takes one tensor's data as ``gguf.GGUFReader`` exposes it
(raw ``uint8`` block bytes whose last axis holds whole blocks, or an ``float32``/``float16`` array
for the plain float types) and returns a C-contiguous ``float32`` array of the logical shape:
``data.shape[:-1] + (num_elements_in_last_axis,)``. Values equal ``gguf.quants.dequantize``
(the reference, ~llama.cpp's ``dequantize_row_*``) up to float32 rounding.

Written from the GGML block layouts (``ggml-common.h``). Every block starts a fresh set of scales,
so the whole tensor is reshaped to ``[num_blocks, type_size]`` and each field is decoded with
broadcasting; no Python loop runs per block. Multi-byte fields are little-endian, as in every GGUF
file llama.cpp writes. This module knows nothing about models or tensor names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

QK_K = 256  # elements per K-quant super-block

_F16 = np.dtype("<f2")
_U32 = np.dtype("<u4")


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 field at byte ``start`` of every block, as float32 ``[num_blocks, 1]``."""
    return blocks[:, start : start + 2].view(_F16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``[n, 16]`` bytes -> ``[n, 32]`` 4-bit values: low nibbles are elements 0-15, high 16-31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _q4_0(blocks: np.ndarray) -> np.ndarray:
    # block_q4_0: d (f16), qs[16]; x = (q - 8) * d
    d = _f16(blocks, 0)
    q = _nibbles(blocks[:, 2:18]).view(np.int8) - np.int8(8)
    return d * q


def _q4_1(blocks: np.ndarray) -> np.ndarray:
    # block_q4_1: d (f16), m (f16), qs[16]; x = q * d + m
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    return d * _nibbles(blocks[:, 4:20]) + m


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """``[n, 4]`` bytes (one little-endian uint32) -> ``[n, 32]`` bit j of element j, times 16."""
    bits = qh.view(_U32) >> np.arange(32, dtype=np.uint32)
    return ((bits & 1) << 4).astype(np.uint8)


def _q5_0(blocks: np.ndarray) -> np.ndarray:
    # block_q5_0: d (f16), qh[4], qs[16]; x = (q5 - 16) * d
    d = _f16(blocks, 0)
    q = (_nibbles(blocks[:, 6:22]) | _fifth_bits(blocks[:, 2:6])).view(np.int8) - np.int8(16)
    return d * q


def _q5_1(blocks: np.ndarray) -> np.ndarray:
    # block_q5_1: d (f16), m (f16), qh[4], qs[16]; x = q5 * d + m
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    return d * (_nibbles(blocks[:, 8:24]) | _fifth_bits(blocks[:, 4:8])) + m


def _q8_0(blocks: np.ndarray) -> np.ndarray:
    # block_q8_0: d (f16), qs[32] (int8); x = q * d
    return _f16(blocks, 0) * blocks[:, 2:34].view(np.int8)


def _per_sub_block(
    scale: np.ndarray, q: np.ndarray, offset: np.ndarray | None = None
) -> np.ndarray:
    """``scale[:, s] * q[:, s, :] (- offset[:, s])`` flattened to ``[n, QK_K]``."""
    y = scale[:, :, None] * q
    if offset is not None:
        y -= offset[:, :, None]
    return y.reshape(len(q), QK_K)


def _q2_k(blocks: np.ndarray) -> np.ndarray:
    # block_q2_K: scales[16] (low nibble scale, high nibble min), qs[64], d, dmin.
    # Element 128h + 32j + 16k + l is bits 2j..2j+1 of qs[32h + 16k + l]; its 16-element
    # sub-block (index = element // 16) owns scales[element // 16].
    n = len(blocks)
    sc = blocks[:, :16]
    qs = blocks[:, 16:80].reshape(n, 2, 1, 32)
    d, dmin = _f16(blocks, 80), _f16(blocks, 82)
    q = (qs >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3  # [n, 2 (h), 4 (j), 32]
    return _per_sub_block(d * (sc & 0x0F), q.reshape(n, 16, 16), dmin * (sc >> 4))


def _q3_k_scales(packed: np.ndarray) -> np.ndarray:
    """12 bytes -> 16 signed 6-bit scales.

    Bytes 0-7 hold the low nibbles (scales 0-7 in the low halves, 8-15 in the high halves); byte
    8 + i holds the top 2 bits of scales i, 4 + i, 8 + i and 12 + i.
    """
    low = np.concatenate([packed[:, :8] & 0x0F, packed[:, :8] >> 4], axis=1)  # [n, 16]
    high = (packed[:, None, 8:12] >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3  # [n, 4, 4]
    return (low | (high.reshape(-1, 16) << 4)).view(np.int8) - np.int8(32)


def _q3_k(blocks: np.ndarray) -> np.ndarray:
    # block_q3_K: hmask[32], qs[64], scales[12], d. Element 128h + 32j + 16k + l has its low 2 bits
    # in qs[32h + 16k + l] >> 2j and its third bit in hmask[16k + l] bit (4h + j); a clear third
    # bit means "subtract 4".
    n = len(blocks)
    hmask = blocks[:, :32]
    qs = blocks[:, 32:96].reshape(n, 2, 1, 32)
    scales = _q3_k_scales(blocks[:, 96:108])
    d = _f16(blocks, 108)
    shifts = np.array([0, 2, 4, 6], np.uint8)[:, None]
    low = ((qs >> shifts) & 3).view(np.int8)  # [n, 2 (h), 4 (j), 32]
    bit = np.arange(8, dtype=np.uint8).reshape(2, 4, 1)  # bit index 4h + j
    minus4 = (((hmask[:, None, None, :] >> bit) & 1) ^ 1).view(np.int8) << 2
    q = (low - minus4).reshape(n, 16, 16)
    return _per_sub_block(d * scales, q)


def _k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """12 bytes -> 8 unsigned 6-bit scales and 8 mins (Q4_K/Q5_K ``get_scale_min_k4``): sub-blocks
    0-3 are the low 6 bits of bytes 0-3 (scale) and 4-7 (min); sub-blocks 4-7 take their low 4 bits
    from the nibbles of bytes 8-11 and their top 2 bits from the spare top bits of bytes 0-7."""
    b0, b4, b8 = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scale = np.concatenate([b0 & 63, (b8 & 0x0F) | ((b0 >> 6) << 4)], axis=1)
    mins = np.concatenate([b4 & 63, (b8 >> 4) | ((b4 >> 6) << 4)], axis=1)
    return scale, mins


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    # block_q4_K: d, dmin, scales[12], qs[128]. Chunk c (64 elements) reads qs[32c:32c+32]: low
    # nibbles are sub-block 2c, high nibbles sub-block 2c + 1; x = d*sc*q - dmin*m.
    n = len(blocks)
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    scale, mins = _k_scale_min(blocks[:, 4:16])
    qs = blocks[:, 16:144].reshape(n, 4, 1, 32)
    q = (qs >> np.array([0, 4], np.uint8)[:, None]) & 0x0F  # [n, 4 (c), 2, 32]
    return _per_sub_block(d * scale, q.reshape(n, 8, 32), dmin * mins)


def _q5_k(blocks: np.ndarray) -> np.ndarray:
    # block_q5_K: d, dmin, scales[12], qh[32], qs[128]. As Q4_K, plus a fifth bit for element l of
    # sub-block s in qh[l] bit s.
    n = len(blocks)
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    scale, mins = _k_scale_min(blocks[:, 4:16])
    qh = blocks[:, None, 16:48]
    qs = blocks[:, 48:176].reshape(n, 4, 1, 32)
    low = ((qs >> np.array([0, 4], np.uint8)[:, None]) & 0x0F).reshape(n, 8, 32)
    high = ((qh >> np.arange(8, dtype=np.uint8)[:, None]) & 1) << 4  # [n, 8, 32]
    return _per_sub_block(d * scale, low | high, dmin * mins)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    # block_q6_K: ql[128], qh[64], scales[16] (int8), d. Half h (128 elements) reads ql[64h:64h+64]
    # and qh[32h:32h+32]; its quarter k = 2s + m takes the nibble s of ql[64h + 32m + l] and bits
    # 2k..2k+1 of qh[32h + l]; x = d * scale[element // 16] * (q6 - 32).
    n = len(blocks)
    ql = blocks[:, :128].reshape(n, 2, 1, 2, 32)
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
    scales = blocks[:, 192:208].view(np.int8)
    d = _f16(blocks, 208)
    low = ((ql >> np.array([0, 4], np.uint8)[:, None, None]) & 0x0F).reshape(n, 2, 4, 32)
    high = (qh >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3  # [n, 2, 4, 32]
    q = (low | (high << 4)).view(np.int8) - np.int8(32)
    return _per_sub_block(d * scales, q.reshape(n, 16, 16))


def _bf16(blocks: np.ndarray) -> np.ndarray:
    # bfloat16 is the top half of a float32.
    return (blocks.view("<u2").astype(np.uint32) << 16).view(np.float32)


_BLOCK_DEQUANTIZERS: dict[GGMLQuantizationType, Callable[[np.ndarray], np.ndarray]] = {
    GGMLQuantizationType.BF16: _bf16,
    GGMLQuantizationType.Q4_0: _q4_0,
    GGMLQuantizationType.Q4_1: _q4_1,
    GGMLQuantizationType.Q5_0: _q5_0,
    GGMLQuantizationType.Q5_1: _q5_1,
    GGMLQuantizationType.Q8_0: _q8_0,
    GGMLQuantizationType.Q2_K: _q2_k,
    GGMLQuantizationType.Q3_K: _q3_k,
    GGMLQuantizationType.Q4_K: _q4_k,
    GGMLQuantizationType.Q5_K: _q5_k,
    GGMLQuantizationType.Q6_K: _q6_k,
}
_FLOAT_TYPES: dict[GGMLQuantizationType, np.dtype[Any]] = {
    GGMLQuantizationType.F32: np.dtype("<f4"),
    GGMLQuantizationType.F16: _F16,
}

SUPPORTED_TYPES: tuple[str, ...] = tuple(t.name for t in (*_FLOAT_TYPES, *_BLOCK_DEQUANTIZERS))


def to_quant_type(qtype: GGMLQuantizationType | int | str) -> GGMLQuantizationType:
    """Normalise a type given as the enum, its integer id, or its name (``"Q4_K"``).

    Raises:
        ValueError: not a GGML type, or one this module cannot dequantize.
    """
    try:
        if isinstance(qtype, str):
            parsed = GGMLQuantizationType[qtype.upper()]
        else:
            parsed = GGMLQuantizationType(int(qtype))
    except (KeyError, ValueError):
        parsed = None
    if parsed is None or parsed.name not in SUPPORTED_TYPES:
        name = parsed.name if parsed is not None else repr(qtype)
        raise ValueError(
            f"GGUF tensor type {name} is not supported; supported types: {list(SUPPORTED_TYPES)}"
        )
    return parsed


def dequantize(data: np.ndarray, qtype: GGMLQuantizationType | int | str) -> np.ndarray:
    """Decode one GGUF tensor to float32.

    Args:
        data: the tensor's data. For quantized types and BF16: ``uint8`` bytes whose last axis is a
            whole number of blocks (the shape ``GGUFReader`` gives, ``[..., row_bytes]``). For F32
            and F16: either that byte form or an array already of that dtype.
        qtype: the GGML type of ``data`` (enum, integer id, or name).

    Returns:
        A new C-contiguous float32 array of shape ``data.shape[:-1] + (elements per row,)``.

    Raises:
        ValueError: unsupported type, or a last axis that is not a whole number of blocks.
    """
    qtype = to_quant_type(qtype)
    data = np.asarray(data)
    if qtype in _FLOAT_TYPES:
        if data.dtype == np.uint8:
            data = np.ascontiguousarray(data).view(_FLOAT_TYPES[qtype])
        # A copy even for float32: GGUFReader hands out read-only views of a file mapping.
        return np.array(data, dtype=np.float32, order="C", copy=True)

    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if data.dtype != np.uint8:
        raise ValueError(f"{qtype.name} data must be raw uint8 bytes, got dtype {data.dtype}")
    if data.ndim == 0 or data.shape[-1] % type_size != 0:
        raise ValueError(
            f"{qtype.name} data's last axis must be a multiple of the {type_size}-byte block, "
            f"got shape {data.shape}"
        )
    out_shape = (*data.shape[:-1], data.shape[-1] // type_size * block_size)
    blocks = np.ascontiguousarray(data).reshape(-1, type_size)
    return _BLOCK_DEQUANTIZERS[qtype](blocks).astype(np.float32, copy=False).reshape(out_shape)


__all__ = ["QK_K", "SUPPORTED_TYPES", "dequantize", "to_quant_type"]
