"""kiln-x86's GGUF weight-only kernels (``kiln_x86.quant``) against gguf's own dequantization.

The reference is ``gguf.quants.dequantize`` (numpy, independent of the code under test) followed
by a float64 matmul. Tolerances, per output element, with ``bound = |x| @ |W|.T`` (the sum of the
magnitudes of its K products):
- float32 activations: the kernels use GGUF's dequantized weights exactly and sum K float32
  products in another order than the reference, so the error is at most about ``K * u * bound``
  (u = 2**-24, the classic bound for a sum of K terms); a lost or doubled group of weights is an
  error of the order of ``bound / K`` and more, far outside it.
- bfloat16 activations: the result is rounded to bfloat16 (half an ulp: ``2**-9 * |y|``) and, above
  ``MAX_KERNEL_ROWS`` rows, the weights are rounded to bfloat16 before the GEMM (``2**-9`` of each
  product): within ``2**-8 * (bound + |y|)``.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from kiln_x86 import quant

ALL_TYPES = [T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]
U = 2.0**-24


def random_raw(qtype: T, out_features: int, in_features: int, seed: int = 0) -> np.ndarray:
    """GGUF bytes ``[out, row_bytes]`` of a random weight. gguf quantizes Q4_0/Q4_1/Q8_0 from
    floats; it has no K-quant quantizer, so K-quant blocks are random bytes with small finite
    float16 super-block scales (every quant value and sub-block scale then occurs)."""
    rng = np.random.default_rng(seed)
    if qtype in (T.Q4_0, T.Q4_1, T.Q8_0):
        w = rng.standard_normal((out_features, in_features)).astype(np.float32)
        w[0] = 0.0  # an all-zero row: scale 0
        return gguf.quants.quantize(w, qtype)
    block_size, block_bytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (out_features, in_features // block_size * block_bytes), np.uint8)
    blocks = raw.reshape(-1, block_bytes)
    scales = (rng.random((blocks.shape[0], 2)) * 0.02).astype(np.float16).view(np.uint8)
    if qtype == T.Q6_K:  # d is the block's last 2 bytes
        blocks[:, -2:] = scales[:, :2]
    else:  # d, dmin first
        blocks[:, :4] = scales
    return raw


def reference(raw: np.ndarray, qtype: T, shape: tuple[int, int]) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(shape))


def int8_rows(x: torch.Tensor) -> torch.Tensor:
    """x rounded as the int8 kernel documents it, in numpy float32: per block of 32, d = max|x| /
    127 and q = x * (127 / max|x|) rounded to nearest even; returns d * q (float64)."""
    xb = x.float().numpy().reshape(x.shape[0], -1, 32)
    amax = np.abs(xb).max(axis=2, keepdims=True)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(xb * inv)
    return torch.from_numpy(d.astype(np.float64) * q).reshape(x.shape)


def int8_applies(packed: quant.PackedWeight, rows: int, int8_max_rows: int) -> bool:
    return quant.int8_kernel_applies(quant.load_quant_kernels(), packed, rows, int8_max_rows)


def assert_int8_close(y: torch.Tensor, x: torch.Tensor, w_ref: torch.Tensor, packed) -> None:
    """The int8 kernel: (1) against the float64 product of the rounded activations (``int8_rows``)
    within float32 rounding: the kernel's float32 terms per block are ``d * dx * sum(u * qx)`` and
    ``(min - o * d) * dx * sum(qx)`` with the weight's unsigned bytes ``u = q + o`` (o <= 136),
    each a few roundings, summed: within ``2 K u B`` with ``B = |xq| @ (|W| + |min| + 136 |d|)``;
    (2) against the exact product within the rounding's worst case: each activation moves by at
    most half its block's step, max|x| / 254 (x 1.001 for the float32 step and products)."""
    xd, wd = x.double(), w_ref.double()
    k = x.shape[-1]
    xq = int8_rows(x)
    scale = packed.scales.double().repeat_interleave(32, dim=1)
    offset = 0 if packed.mins is None else packed.mins.double().repeat_interleave(32, dim=1)
    big = xq.abs() @ (wd.abs() + offset.abs() if packed.mins is not None else wd.abs()).T
    big = big + 136 * (xq.abs() @ scale.abs().T)
    step = xd.abs().reshape(x.shape[0], -1, 32).amax(dim=2).repeat_interleave(32, dim=1) / 254
    rounding = 1.001 * (step @ wd.abs().T)
    out = y.double()
    if y.dtype == torch.bfloat16:  # the result rounded to bfloat16: half an ulp
        slack = 2.0**-8 * out.abs()
    else:
        slack = 0.0
    err_q = ((out - xq @ wd.T).abs() / (2 * k * U * big + slack + 1e-30)).max().item()
    assert err_q <= 1.0, f"error {err_q:.3g}x the tolerance against the rounded activations"
    err = ((out - xd @ wd.T).abs() / (rounding + 2 * k * U * big + slack + 1e-30)).max().item()
    assert err <= 1.0, f"error {err:.3g}x the int8 rounding bound"


def assert_matmul_close(
    y: torch.Tensor, x: torch.Tensor, w_ref: torch.Tensor, packed=None, int8_max_rows: int = 0
) -> None:
    """``packed``: the weight when y is ``quant.matmul(x, packed, int8_max_rows)``'s (the int8
    bound where that runs)."""
    if packed is not None and int8_applies(packed, x.shape[0], int8_max_rows):
        assert y.dtype == x.dtype and y.shape == (x.shape[0], w_ref.shape[0])
        assert_int8_close(y, x, w_ref, packed)
        return
    xd, wd = x.double(), w_ref.double()
    ref = xd @ wd.T
    bound = xd.abs() @ wd.abs().T
    if x.dtype == torch.float32:
        tol = x.shape[-1] * U * bound + 1e-30
    else:
        tol = 2.0**-8 * (bound + ref.abs()) + 1e-30
    assert y.dtype == x.dtype and y.shape == ref.shape
    err = (y.double() - ref).abs()
    worst = (err / tol).max().item()
    assert worst <= 1.0, f"error {worst:.3g}x the tolerance"


@pytest.fixture(scope="module")
def ext():
    module = quant.load_quant_kernels()
    assert module is not None, "the x86_quant kernels did not build on this machine"
    return module


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_is_gguf_exactly(qtype: T, ext) -> None:
    out_features, in_features = 37, 512  # out not a multiple of 8 or 16
    raw = random_raw(qtype, out_features, in_features)
    packed = quant.pack(torch.from_numpy(raw), qtype, out_features, in_features)
    ref = reference(raw, qtype, (out_features, in_features))
    assert torch.equal(quant.dequantize(packed), ref)
    assert torch.equal(quant.dequantize(packed, torch.bfloat16), ref.bfloat16())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_matmul_against_dequantized_reference(qtype: T, dtype: torch.dtype, ext) -> None:
    out_features, in_features = 45, 768
    raw = random_raw(qtype, out_features, in_features, seed=1)
    packed = quant.pack(torch.from_numpy(raw), qtype, out_features, in_features)
    w_ref = reference(raw, qtype, (out_features, in_features))
    gen = torch.Generator().manual_seed(0)
    rows_cases = [1, 3, 17, quant.MAX_KERNEL_ROWS, quant.MAX_KERNEL_ROWS + 1, 40]
    for rows in rows_cases:
        x = torch.randn(rows, in_features, generator=gen).to(dtype)
        assert_matmul_close(quant.matmul(x, packed), x, w_ref, packed)
        # With int8 activations (opt-in): the int8 bound up to INT8_ROWS rows where it runs.
        y = quant.matmul(x, packed, quant.INT8_ROWS)
        assert_matmul_close(y, x, w_ref, packed, quant.INT8_ROWS)
        # The C++ kernel alone at every row count (matmul hands many rows to the dense GEMM).
        y = ext.qmatmul(x, packed.qweight, packed.scales, packed.mins, packed.group, packed.bits)
        assert_matmul_close(y, x, w_ref)
    x = torch.randn(2, 3, in_features, generator=gen).to(dtype)  # leading dims kept
    y = quant.matmul(x, packed)
    assert y.shape == (2, 3, out_features)
    assert_matmul_close(y.reshape(6, -1), x.reshape(6, -1), w_ref, packed)


@pytest.mark.parametrize("qtype", [t for t in ALL_TYPES if t != T.Q6_K], ids=lambda t: t.name)
def test_int8_kernel(qtype: T, ext) -> None:
    """The AVX512-VNNI kernel alone at every row tile (8 rows and 1-7 left over), an odd number
    of blocks (96 inputs: the last pair half empty) and an all-zero activation row."""
    if not hasattr(ext, "qmatmul_int8"):
        pytest.skip("no AVX512-VNNI on this CPU: the int8 kernel is not built")
    gen = torch.Generator().manual_seed(4)
    for in_features in (96, 768) if qtype in (T.Q4_0, T.Q4_1, T.Q8_0) else (256, 768):
        raw = random_raw(qtype, 21, in_features, seed=5)
        packed = quant.pack(torch.from_numpy(raw), qtype, 21, in_features)
        w_ref = reference(raw, qtype, (21, in_features))
        for rows in (1, 5, 8, 19):
            for dtype in (torch.float32, torch.bfloat16):
                x = (torch.randn(rows, in_features, generator=gen) * 3).to(dtype)
                x[-1, :32] = 0.0
                y = ext.qmatmul_int8(
                    x, packed.qweight, packed.scales, packed.mins, packed.group, packed.bits
                )
                assert_int8_close(y, x, w_ref, packed)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_torch_fallback_without_compiler(qtype: T, monkeypatch) -> None:
    """Where the C++ cannot be built, the same packed layout runs through torch ops."""
    monkeypatch.setattr(quant, "load_quant_kernels", lambda: None)
    raw = random_raw(qtype, 19, 256, seed=2)
    packed = quant.pack(torch.from_numpy(raw), qtype, 19, 256)
    w_ref = reference(raw, qtype, (19, 256))
    assert torch.equal(quant.dequantize(packed), w_ref)
    x = torch.randn(3, 256)
    assert_matmul_close(quant.matmul(x, packed), x, w_ref, packed)
    ids = torch.tensor([18, 0, 5])
    assert torch.equal(quant.embedding(ids, packed), w_ref[ids])


@pytest.fixture(scope="module")
def gguf_tensors(gguf_path: str) -> dict[str, gguf.ReaderTensor]:
    reader = gguf.GGUFReader(gguf_path)
    return {t.name: t for t in reader.tensors}


# The default model's linear shapes (Q4_1) and its tied embedding / lm_head (Q8_0).
REAL_TENSORS = [
    "blk.0.attn_q.weight",
    "blk.0.attn_k.weight",
    "blk.0.ffn_up.weight",
    "blk.29.ffn_down.weight",
    "token_embd.weight",
]


@pytest.mark.parametrize("name", REAL_TENSORS)
def test_real_gguf_tensors(name: str, gguf_tensors, ext) -> None:
    tensor = gguf_tensors[name]
    in_features, out_features = (int(d) for d in tensor.shape)
    qtype = T(tensor.tensor_type)
    assert qtype == (T.Q8_0 if name == "token_embd.weight" else T.Q4_1)
    raw = np.asarray(tensor.data)
    packed = quant.pack(torch.from_numpy(raw.copy()), qtype, out_features, in_features)
    w_ref = reference(raw, qtype, (out_features, in_features))
    assert torch.equal(quant.dequantize(packed), w_ref)
    gen = torch.Generator().manual_seed(0)
    for rows in (1, 3, 17):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(rows, in_features, generator=gen).to(dtype)
            assert_matmul_close(quant.matmul(x, packed), x, w_ref, packed)
    ids = torch.tensor([[0, out_features - 1, 7], [7, 1, 0]])
    rows = quant.embedding(ids, packed)
    assert rows.shape == (2, 3, in_features)
    assert torch.equal(rows, w_ref[ids])
    assert torch.equal(quant.embedding(ids, packed, torch.bfloat16), w_ref[ids].bfloat16())


def test_packed_size_near_the_gguf_size() -> None:
    """The default model's formats stay within the issue's 1.3x of the GGUF bytes."""
    for qtype, limit in ((T.Q4_0, 1.12), (T.Q4_1, 1.21), (T.Q8_0, 1.06)):
        raw = random_raw(qtype, 64, 576)
        packed = quant.pack(torch.from_numpy(raw), qtype, 64, 576)
        assert packed.nbytes <= limit * raw.nbytes


def test_bad_input_names_field_and_allowed_values() -> None:
    raw = torch.from_numpy(random_raw(T.Q4_1, 8, 64))
    with pytest.raises(ValueError, match=r"qtype=Q5_0 .*allowed: Q4_0, Q4_1, Q8_0, Q4_K"):
        quant.pack(raw, T.Q5_0, 8, 64)
    with pytest.raises(ValueError, match=r"raw has .*allowed: torch.uint8 \[8, 40\]"):
        quant.pack(raw[:, :20], T.Q4_1, 8, 64)
    with pytest.raises(ValueError, match=r"in_features=48 .*multiple of its block size 32"):
        quant.pack(raw, T.Q4_1, 8, 48)
    packed = quant.pack(raw, T.Q4_1, 8, 64)
    with pytest.raises(ValueError, match=r"x has 63 features .*allowed: 64"):
        quant.matmul(torch.randn(2, 63), packed)
    with pytest.raises(ValueError, match=r"x.dtype=torch.float16 .*allowed: float32, bfloat16"):
        quant.matmul(torch.randn(2, 64).half(), packed)


def test_dense_path_in_tiles(monkeypatch, ext) -> None:
    """Many rows against a weight taller than a tile: dequantized and multiplied tile by tile,
    the last tile partial."""
    monkeypatch.setattr(quant, "DENSE_TILE_ROWS", 16)
    raw = random_raw(T.Q4_1, 45, 256, seed=3)
    packed = quant.pack(torch.from_numpy(raw), T.Q4_1, 45, 256)
    w_ref = reference(raw, T.Q4_1, (45, 256))
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(quant.MAX_KERNEL_ROWS + 5, 256).to(dtype)
        assert_matmul_close(quant.matmul(x, packed), x, w_ref, packed)
