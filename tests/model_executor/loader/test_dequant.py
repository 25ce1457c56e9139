"""Kiln's GGUF dequantizer against the reference, ``gguf.quants.dequantize``."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T

from kiln.model_executor.loader.dequant import SUPPORTED_TYPES, dequantize, to_quant_type
from kiln.model_executor.loader.gguf_loader import open_gguf

# Byte offsets of each block type's float16 scale fields; the other bytes may be anything.
_F16_FIELDS = {
    T.Q4_0: [0],
    T.Q4_1: [0, 2],
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.Q8_0: [0],
    T.Q2_K: [80, 82],
    T.Q3_K: [108],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
}
_QUANTIZABLE = [T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]


def _random_blocks(qtype: T, rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    """Random block bytes with finite float16 scales: every bit pattern of the quants is valid."""
    rng = np.random.default_rng(seed)
    _, type_size = GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(rows * blocks_per_row, type_size), dtype=np.uint8)
    for offset in _F16_FIELDS[qtype]:
        scales = rng.normal(0, 0.05, size=(len(data), 1)).astype(np.float16)
        data[:, offset : offset + 2] = scales.view(np.uint8)
    return data.reshape(rows, blocks_per_row * type_size)


@pytest.mark.parametrize("qtype", list(_F16_FIELDS), ids=lambda t: t.name)
def test_random_blocks_match_reference(qtype: T) -> None:
    data = _random_blocks(qtype, rows=6, blocks_per_row=3, seed=int(qtype))
    expected = quants.dequantize(data, qtype)
    got = dequantize(data, qtype)
    block_size, _ = GGML_QUANT_SIZES[qtype]
    assert got.shape == (6, 3 * block_size) == expected.shape
    assert got.dtype == np.float32 and got.flags.c_contiguous
    assert np.abs(expected).max() > 0
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("qtype", _QUANTIZABLE, ids=lambda t: t.name)
def test_quantized_normal_data_matches_reference(qtype: T) -> None:
    values = np.random.default_rng(1).normal(size=(4, 3, 64)).astype(np.float32)
    data = quants.quantize(values, qtype)
    got = dequantize(data, qtype)
    np.testing.assert_allclose(got, quants.dequantize(data, qtype), rtol=1e-6, atol=1e-7)
    assert got.shape == values.shape
    # Sanity that the round trip is a real quantization of the input, not noise.
    assert np.abs(got - values).max() < 0.5


@pytest.mark.parametrize("qtype", [T.F32, T.F16])
def test_float_types_are_copied_to_float32(qtype: T) -> None:
    values = np.arange(12, dtype=np.float32).reshape(3, 4) / 8
    stored = values.astype(np.float16 if qtype == T.F16 else np.float32)
    stored.flags.writeable = False  # like GGUFReader's memory-mapped arrays
    got = dequantize(stored, qtype)
    np.testing.assert_array_equal(got, values)
    assert got.dtype == np.float32 and got.flags.writeable
    assert not np.shares_memory(got, stored)
    # The byte form decodes to the same values.
    np.testing.assert_array_equal(dequantize(stored.view(np.uint8), qtype), values)


def test_unsupported_type_names_it_and_the_supported_ones() -> None:
    data = np.zeros((1, GGML_QUANT_SIZES[T.IQ2_XXS][1]), np.uint8)
    with pytest.raises(ValueError, match="IQ2_XXS") as excinfo:
        dequantize(data, T.IQ2_XXS)
    assert "Q4_K" in str(excinfo.value) and "Q8_0" in str(excinfo.value)
    with pytest.raises(ValueError, match="not supported"):
        to_quant_type(999)
    assert to_quant_type("q4_k") is T.Q4_K and to_quant_type(2) is T.Q4_0
    assert set(SUPPORTED_TYPES) >= {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"}


def test_partial_block_is_rejected() -> None:
    with pytest.raises(ValueError, match="multiple of the 34-byte block"):
        dequantize(np.zeros((2, 50), np.uint8), T.Q8_0)


@pytest.mark.slow
def test_real_tensors_of_default_model_match_reference(default_gguf: str) -> None:
    first_of_type = {}
    for tensor in open_gguf(default_gguf).tensors:
        first_of_type.setdefault(tensor.tensor_type, tensor)
    assert {T.Q4_1, T.Q8_0, T.F32} <= set(first_of_type)
    for qtype, tensor in first_of_type.items():
        assert dequantize(tensor.data, qtype).shape == tuple(int(d) for d in reversed(tensor.shape))
        rows = tensor.data[:2048]  # rows are independent; the reference is slow on 49k of them
        np.testing.assert_allclose(
            dequantize(rows, qtype),
            quants.dequantize(rows, qtype),
            rtol=1e-6,
            atol=1e-7,
            err_msg=tensor.name,
        )
