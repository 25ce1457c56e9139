"""kiln-x86's tiled int8-activation kernel (``kiln_x86.gemv``) against gguf's dequantization.

References are independent of the code under test: ``gguf.quants.dequantize`` (numpy) for the
weights and a float64 matmul. The kernel rounds each activation row to int8 per block of 32
(``x ~= dx * qx``, ``dx = max|x| / 127``, ``qx = rint(x * (127 / max|x|))``; ``int8_rows``
rounds it so in numpy) and then sums exact integer products per block, so per output element:

- against the product of the rounded activations, ``xq @ W.T`` in float64, only float32
  rounding is left: a few roundings per block term (``float(isum) * (scale * dx)``, ``min * (dx
  * sum(qx))``) and one per accumulation, within ``2 K u B`` with ``B = |xq| @ (|W| + |min|).T``
  (u = 2**-24; a lost, doubled or misplaced block of 32 is an error of order ``B / K * 32``);
- against the exact ``x @ W.T``: plus the rounding's worst case, each activation moved by at most
  half its block's step (``max|x| / 254``, x 1.001 for the float32 step): ``step @ |W|.T``;
- bfloat16 results: plus half an ulp of the result, ``2**-9 |y|`` (2**-8 for slack).
"""

from __future__ import annotations

import os
from types import ModuleType

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from kiln_x86 import gemv, kernels, quant
from kiln_x86.linear_methods import X86GGUFInt8ActivationsLinearMethod
from test_x86_quant import ALL_TYPES, U, int8_rows, random_raw, reference

from kiln.model_executor.layers.quantization import GGUFQuantConfig, model_weight_bytes
from kiln.model_executor.model_loader import load_model
from kiln.plugin_api import cpu_flags

pytestmark = pytest.mark.skipif(
    not gemv.available(), reason="the tiled int8 kernel needs a compiler and AVX2 or AVX512-VNNI"
)


def mins_of(qtype: T, raw: np.ndarray, shape: tuple[int, int]) -> torch.Tensor:
    """|min| per weight (float64 ``[out, in]``), from gguf's own dequantization: the value of a
    zero quant (the formats with mins are unsigned with offset 0: w(q=0) = min)."""
    if qtype not in (T.Q4_1, T.Q4_K, T.Q5_K):
        return torch.zeros(shape, dtype=torch.float64)
    zero = quant.pack(torch.from_numpy(raw), qtype, *shape)  # the row layout, exact
    return zero.mins.double().abs().repeat_interleave(32, dim=1)


def assert_within_int8_bound(y, x, w_ref, w_min) -> None:
    xd, wd = x.double(), w_ref.double()
    k = x.shape[-1]
    xq = int8_rows(x)
    big = xq.abs() @ (wd.abs() + w_min).T
    step = xd.abs().reshape(x.shape[0], -1, 32).amax(dim=2).repeat_interleave(32, dim=1) / 254
    rounding = 1.001 * (step @ wd.abs().T)
    out = y.double()
    slack = 2.0**-8 * out.abs() if y.dtype == torch.bfloat16 else 0.0
    assert y.dtype == x.dtype and y.shape == (x.shape[0], w_ref.shape[0])
    err_q = ((out - xq @ wd.T).abs() / (2 * k * U * big + slack + 1e-30)).max().item()
    assert err_q <= 1.0, f"error {err_q:.3g}x the tolerance against the rounded activations"
    err = ((out - xd @ wd.T).abs() / (rounding + 2 * k * U * big + slack + 1e-30)).max().item()
    assert err <= 1.0, f"error {err:.3g}x the int8 rounding bound"


def tiled_case(qtype: T, out_features: int, in_features: int, seed: int):
    raw = random_raw(qtype, out_features, in_features, seed=seed)
    shape = (out_features, in_features)
    tiled = quant.pack(torch.from_numpy(raw), qtype, *shape, tiled=True)
    assert isinstance(tiled, gemv.TiledWeight)
    return tiled, reference(raw, qtype, shape), mins_of(qtype, raw, shape)


def in_sizes(qtype: T) -> tuple[int, ...]:
    return (32, 96) if qtype in (T.Q4_0, T.Q4_1, T.Q8_0) else (256, 768)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_tiled_rows_are_gguf_exactly(qtype: T) -> None:
    for out_features in (37, 16):  # a partial tile, one whole tile
        for in_features in in_sizes(qtype):
            tiled, w_ref, _ = tiled_case(qtype, out_features, in_features, seed=out_features)
            assert torch.equal(quant.dequantize(tiled), w_ref)
            assert torch.equal(quant.dequantize(tiled, torch.bfloat16), w_ref.bfloat16())
            ids = torch.tensor([[out_features - 1, 0], [15, 15]])
            assert torch.equal(quant.embedding(ids, tiled), w_ref[ids])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_tiled_matmul_within_the_int8_bound(qtype: T, dtype: torch.dtype) -> None:
    """1..16 rows (every row tile: 8 or 4 per pass and what is left), N not a multiple of 16,
    the smallest K, an all-zero activation block and row."""
    gen = torch.Generator().manual_seed(7)
    for out_features, in_features in ((45, in_sizes(qtype)[0]), (21, in_sizes(qtype)[1])):
        tiled, w_ref, w_min = tiled_case(qtype, out_features, in_features, seed=3)
        for rows in (1, 3, 4, 5, 8, 9, 16):
            x = (torch.randn(rows, in_features, generator=gen) * 3).to(dtype)
            x[-1, :32] = 0.0
            assert_within_int8_bound(quant.matmul(x, tiled), x, w_ref, w_min)
        x = torch.zeros(2, in_features, dtype=dtype)
        assert torch.equal(quant.matmul(x, tiled), torch.zeros(2, out_features, dtype=dtype))


def test_tiled_rows_do_not_depend_on_the_batch_or_threads() -> None:
    """Row i of a 16-row call equals the same row alone, bit for bit, on 1 and 2 threads: a
    prefix-cache hit's short prefill and a decode see the same per-row arithmetic."""
    tiled, _, _ = tiled_case(T.Q4_1, 70, 576, seed=9)
    # float32 results: a bfloat16 result's rounding would hide a last-bit difference.
    x = torch.randn(16, 576, generator=torch.Generator().manual_seed(1))
    batched = same_on_one_and_two_threads(lambda: quant.matmul(x, tiled))
    for i in (0, 7, 8, 15):
        assert torch.equal(quant.matmul(x[i : i + 1], tiled)[0], batched[i])


@pytest.mark.parametrize("rows", [1, 3, 16, 64, 200])
def test_helper_threads_give_the_same_rows(rows: int) -> None:
    """With matmul helper threads (``x86.helper_threads``) sharing a call's chunks, every row is
    bit for bit the call's result without them, for decode and prefill row counts; each output
    tile is written exactly once (the LM head's 3072 tiles included)."""
    ext = gemv.load_gemv_kernels()
    gen = torch.Generator().manual_seed(rows)
    cases = [tiled_case(T.Q4_1, 1000, 576, seed=3)[0], tiled_case(T.Q8_0, 49152, 64, seed=4)[0]]
    for tiled in cases:
        x = torch.randn(rows, tiled.in_features, generator=gen)
        alone = ext.gemv(x, tiled.data, *tiled.args())
        try:
            ext.set_pool_helpers([-1, -1])
            assert ext.pool_helpers() == 2
            shared = [ext.gemv(x, tiled.data, *tiled.args()) for _ in range(3)]
        finally:
            ext.set_pool_helpers([])
        assert ext.pool_helpers() == 0
        for out in shared:
            assert torch.equal(out, alone)


AVX2_FLAGS = ["-mno-avx512f", "-DKILN_GEMV_LIBRARY=kiln_x86_gemv_avx2"]
"""The kernel as a CPU without AVX-512 builds it (its AVX2 kernel), with its own op namespace: a
process loads one ``TORCH_LIBRARY`` per name, and the default build has ``kiln_x86_gemv``."""


@pytest.fixture(scope="module")
def avx2_kernels() -> ModuleType:
    """The AVX2 build (once per machine, like the others), beside this machine's own."""
    if "avx512_vnni" not in cpu_flags():
        pytest.skip("compares the AVX2 kernel with the AVX512-VNNI one: needs a CPU with both")
    flags = [*gemv.build_flags(), *AVX2_FLAGS]
    module = kernels.load_extension("kiln_x86_gemv_avx2", gemv.SOURCE, flags)
    assert module is not None and hasattr(module, "gemv"), "the AVX2 build has no gemv"
    return module


AVX2_ROWS = (1, 3, 8, 17, 64, 65, 300)


def extreme_case(qtype: T, out_features: int, in_features: int, seed: int) -> gemv.TiledWeight:
    """Weights all 0 or all ``2**bits - 1`` per block (the largest products a pair sums: an int16
    overflow or saturation would show), unit scales and mins."""
    f = gemv.FORMATS[qtype]
    rng = np.random.default_rng(seed)
    top = rng.integers(0, 2, (out_features, in_features // 32, 1), dtype=np.uint8)
    u = np.broadcast_to(top * (2**f.bits - 1), (out_features, in_features // 32, 32))
    scales = rng.uniform(0.5, 1.0, (out_features, in_features // f.group)).astype(np.float32)
    mins = np.full((out_features, in_features // 32), -0.25, np.float32) if f.has_mins else None
    return gemv.pack(u.reshape(out_features, in_features), scales, mins, qtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_avx2_kernel_gives_the_vnni_kernels_bits(qtype: T, dtype: torch.dtype, avx2_kernels):
    """The AVX2 build's gemv equals the AVX512-VNNI build's bit for bit, for every row count
    (its row passes, pairs of tiles from 8 rows, 64-row chunks), N not a multiple of 16, with and
    without pool helpers: random weights, and all-0 / all-max ones against activations of
    +-max|x| (qx = +-127), the sums' extremes."""
    vnni = gemv.load_gemv_kernels()
    gen = torch.Generator().manual_seed(21)
    k = in_sizes(qtype)[1]
    x = (torch.randn(max(AVX2_ROWS), k, generator=gen) * 3).to(dtype)
    x[5, 32:64] = 0.0  # an all-zero activation block
    x[7] = torch.where(torch.rand(k, generator=gen) < 0.5, -4.0, 4.0).to(dtype)
    x[9, :32] = x[7, :32].abs()
    weights = [tiled_case(qtype, 45, k, seed=5)[0], extreme_case(qtype, 37, k, seed=6)]
    for tiled in weights:
        want = vnni.gemv(x, tiled.data, *tiled.args())
        for rows in AVX2_ROWS:
            got = avx2_kernels.gemv(x[:rows], tiled.data, *tiled.args())
            assert torch.equal(got, want[:rows]), rows
        try:
            avx2_kernels.set_pool_helpers([-1, -1])
            for rows in (1, 17, 300):
                got = avx2_kernels.gemv(x[:rows], tiled.data, *tiled.args())
                assert torch.equal(got, want[:rows]), ("helpers", rows)
        finally:
            avx2_kernels.set_pool_helpers([])


def test_avx2_build_registers_its_own_ops(avx2_kernels) -> None:
    """Both builds' ops load in one process, each under its namespace, the same kernel."""
    tiled = tiled_case(T.Q4_1, 21, 256, seed=2)[0]
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(3))
    want = gemv.load_gemv_kernels().gemv(x, tiled.data, *tiled.args())
    got = torch.ops.kiln_x86_gemv_avx2.gemv(x, tiled.data, *tiled.args())
    assert torch.equal(got, want)
    assert torch.equal(torch.ops.kiln_x86_gemv.gemv(x, tiled.data, *tiled.args()), want)


def same_on_one_and_two_threads(run) -> torch.Tensor:
    """``run()``'s result on 1 thread, checked equal to its result on 2."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(2)
        assert torch.equal(run(), one)
    finally:
        torch.set_num_threads(threads)
    return one


def decode_rows(x: torch.Tensor, tiled: gemv.TiledWeight) -> torch.Tensor:
    """Each row of x through the decode kernel alone (``gemv``, one row per call)."""
    ext = gemv.load_gemv_kernels()
    return torch.cat([ext.gemv(x[i : i + 1], tiled.data, *tiled.args()) for i in range(len(x))])


PREFILL_ROWS = (1, 63, 64, 65, 200, 1000)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_every_row_count_gives_the_decode_kernels_rows(qtype: T, dtype: torch.dtype) -> None:
    """A row's result is the one-row decode kernel's, bit for bit, whatever the call's row count
    (AMX tiles from ``AMX_MIN_ROWS`` rows where they run, else the VNNI kernel in chunks; row
    counts across 16-row tiles, 64-row batches and 256-row chunks), with N not a multiple of 16.
    float32 results show a last-bit difference in the sums; bfloat16 ones the output rounding."""
    gen = torch.Generator().manual_seed(11)
    tiled, _, _ = tiled_case(qtype, 45, in_sizes(qtype)[1], seed=5)
    x = (torch.randn(max(PREFILL_ROWS), tiled.in_features, generator=gen) * 3).to(dtype)
    x[5, 32:64] = 0.0  # an all-zero activation block
    want = decode_rows(x, tiled)
    for rows in PREFILL_ROWS:
        assert torch.equal(quant.matmul(x[:rows], tiled), want[:rows]), rows


def test_prefill_without_amx_gives_the_same_rows(monkeypatch) -> None:
    """Where the AMX kernel may not run, many rows go through the VNNI kernel (chunks of 64 rows
    in one parallel region, on 1 and 2 threads): the same rows again. 300 rows x 5 tiles of 16
    channels: the second thread's share starts inside a chunk, which both threads round."""
    tiled, _, _ = tiled_case(T.Q4_1, 70, 576, seed=6)
    x = torch.randn(300, 576, generator=torch.Generator().manual_seed(3))
    want = quant.matmul(x, tiled)
    monkeypatch.setattr(gemv, "amx_available", lambda: False)
    assert torch.equal(same_on_one_and_two_threads(lambda: quant.matmul(x, tiled)), want)
    assert torch.equal(want, decode_rows(x, tiled))


@pytest.mark.skipif(not gemv.amx_available(), reason="needs AMX-INT8 and Linux's tile permission")
def test_amx_kernel_runs_from_its_row_count_on_any_thread_count(monkeypatch) -> None:
    tiled, _, _ = tiled_case(T.Q8_0, 70, 576, seed=8)
    x = torch.randn(300, 576, generator=torch.Generator().manual_seed(4))
    ext, calls = gemv.load_gemv_kernels(), []
    monkeypatch.setattr(gemv, "load_gemv_kernels", lambda: SpyKernels(ext, calls))
    same_on_one_and_two_threads(lambda: quant.matmul(x, tiled))
    quant.matmul(x[: gemv.AMX_MIN_ROWS - 1], tiled)
    assert calls == ["gemm_amx", "gemm_amx", "gemv"]


class SpyKernels:
    """The extension's kernels, noting which one each call ran."""

    def __init__(self, ext, calls: list[str]) -> None:
        self.ext, self.calls = ext, calls

    def __getattr__(self, name: str):
        kernel = getattr(self.ext, name)
        return lambda *args: self.calls.append(name) or kernel(*args)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_prefill_rows_within_the_int8_bound(qtype: T) -> None:
    gen = torch.Generator().manual_seed(12)
    tiled, w_ref, w_min = tiled_case(qtype, 21, in_sizes(qtype)[1], seed=4)
    for rows, dtype in ((65, torch.float32), (200, torch.bfloat16)):
        x = (torch.randn(rows, tiled.in_features, generator=gen) * 3).to(dtype)
        assert_within_int8_bound(quant.matmul(x, tiled), x, w_ref, w_min)


def test_tiled_size_against_the_gguf_bytes() -> None:
    # float16 scales: the legacy formats' own bytes; float32 for the K-quants (see kiln_x86.gemv).
    limits = {T.Q4_0: 1.0, T.Q4_1: 1.0, T.Q8_0: 1.0, T.Q4_K: 4 / 3, T.Q5_K: 1.28, T.Q6_K: 1.22}
    for qtype, limit in limits.items():
        raw = random_raw(qtype, 64, 512)
        tiled = quant.pack(torch.from_numpy(raw), qtype, 64, 512, tiled=True)
        assert tiled.nbytes <= limit * raw.nbytes, (qtype.name, tiled.nbytes / raw.nbytes)


# The default model's linear shapes (Q4_1) and its tied embedding / LM head (Q8_0).
REAL = ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.29.ffn_down.weight", "token_embd.weight"]


@pytest.fixture(scope="module")
def gguf_tensors(gguf_path: str) -> dict[str, gguf.ReaderTensor]:
    return {t.name: t for t in gguf.GGUFReader(gguf_path).tensors if t.name in REAL}


@pytest.mark.parametrize("name", REAL)
def test_real_gguf_tensors(name: str, gguf_tensors) -> None:
    tensor = gguf_tensors[name]
    in_features, out_features = (int(d) for d in tensor.shape)
    qtype = T(tensor.tensor_type)
    raw = np.asarray(tensor.data).copy()
    shape = (out_features, in_features)
    tiled = quant.pack(torch.from_numpy(raw), qtype, *shape, tiled=True)
    w_ref = reference(raw, qtype, shape)
    assert torch.equal(quant.dequantize(tiled), w_ref)
    w_min = mins_of(qtype, raw, shape)
    gen = torch.Generator().manual_seed(0)
    # 100 rows: the prefill kernel (the 49152-row table's float64 reference would take seconds).
    for rows in (1, 16) if out_features > 10_000 else (1, 16, 100):
        x = torch.randn(rows, in_features, generator=gen).bfloat16()
        assert_within_int8_bound(quant.matmul(x, tiled), x, w_ref, w_min)


@pytest.fixture(scope="module")
def int8_model(gguf_path):
    config = GGUFQuantConfig(X86GGUFInt8ActivationsLinearMethod)
    model, _ = load_model(gguf_path, torch.bfloat16, quant_config=config)
    return model


def test_linear_method_routes_through_the_tiled_kernel(int8_model, gguf_path, monkeypatch) -> None:
    """With ``int8_activations``, every GGUF weight of the default model is kept only tiled
    (within 1.3x of the file), and its linears, embedding and tied LM head run the kernel."""
    assert model_weight_bytes(int8_model) <= 1.3 * os.path.getsize(gguf_path)
    parts = [
        part
        for module in int8_model.modules()
        if getattr(module, "quant_method", None) and not getattr(module, "_tied_to", ())
        for _, part in module.gguf_parts
    ]
    assert len(parts) == 30 * 4 + 1 and all(isinstance(p, gemv.TiledWeight) for p in parts)
    calls = []
    kernel = gemv.matmul
    monkeypatch.setattr(gemv, "matmul", lambda x, tiled: calls.append(tiled) or kernel(x, tiled))
    gen = torch.Generator().manual_seed(2)
    layer = int8_model.get_submodule("model.layers.3.mlp.down_proj")
    x = torch.randn(4, 1536, generator=gen).bfloat16()
    ((_, packed),) = layer.gguf_parts
    # The method's own route (a layer call takes kiln_x86.ops' linear op where the x86 ops are
    # registered: the same kernel, called directly; test_x86_ops.py checks it).
    assert torch.equal(layer.forward_native(x), kernel(x, packed)) and calls == [packed]
    ((_, table),) = int8_model.model.embed_tokens.gguf_parts
    hidden = torch.randn(2, 576, generator=gen).bfloat16()
    assert torch.equal(int8_model.compute_logits(hidden), kernel(hidden, table))
    assert calls[-1] is table
    ids = torch.tensor([0, 49151, 1234])
    want = quant.dequantize(table)[ids].bfloat16()
    assert torch.equal(int8_model.model.embed_tokens(ids), want)
