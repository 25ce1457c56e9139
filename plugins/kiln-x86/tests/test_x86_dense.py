"""``kiln_x86.dense``: a dense bf16 linear runs kiln-x86's AVX512-BF16 kernel where it builds (a
row's result the same whatever the call's other rows), else oneDNN's packed product; a trace
records either as one op that replays the eager rows (the kernel's with the tiled weight as its
constant, oneDNN's on the plain weight, since the packed one cannot be a trace's constant); the
LM head runs the same product."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from kiln_x86 import dense

from kiln.model_executor.layers.linear import ReplicatedLinear

pytestmark = pytest.mark.skipif(
    not dense.onednn_bf16_available(), reason="oneDNN has no bfloat16 here"
)


@pytest.fixture(scope="module")
def layer() -> ReplicatedLinear:
    assert dense.register_dense_ops()
    generator = torch.Generator().manual_seed(0)
    layer = ReplicatedLinear(192, 320, bias=True, params_dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(320, 192, generator=generator) / 16)
        layer.bias.copy_(torch.randn(320, generator=generator))
    return layer


needs_kernel = pytest.mark.skipif(
    not dense.kernel_available(), reason="kiln-x86's dense kernel needs AVX512-BF16"
)


@pytest.fixture(params=["kernel", "onednn"])
def product(request, monkeypatch) -> str:
    """Each test of this fixture runs with the kernel (where it runs) and with oneDNN."""
    if request.param == "kernel" and not dense.kernel_available():
        pytest.skip("kiln-x86's dense kernel needs AVX512-BF16")
    if request.param == "onednn":
        monkeypatch.setattr(dense, "_kernel", lambda: None)
    return request.param


def test_traced_dense_linear_records_one_op_and_replays_the_eager_rows(layer, product):
    x = torch.randn(4, 192, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
    assert dense._linear_supports(layer, x)
    eager = dense.linear(layer, x)
    torch.testing.assert_close(eager, F.linear(x, layer.weight, layer.bias), rtol=0.02, atol=0.02)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = torch.jit.trace(lambda x: dense.linear(layer, x), (x,), check_trace=False)
    kinds = [node.kind() for node in graph.graph.nodes()]
    op = "kiln_x86_dense_bf16::linear" if product == "kernel" else "kiln_x86_dense::linear"
    assert kinds.count(op) == 1, graph.graph
    assert not [kind for kind in kinds if kind.startswith("mkldnn::")], graph.graph
    assert torch.equal(graph(x), eager)


def _exact(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The product in float64, rounded once to bfloat16."""
    out = x.double() @ weight.double().T
    return (out if bias is None else out + bias.double()).to(torch.bfloat16)


@needs_kernel
@pytest.mark.parametrize("out_features", [16, 17, 200, 64 + 5])
@pytest.mark.parametrize("with_bias", [True, False])
def test_kernel_is_the_product_rounded_once_for_every_row_count(out_features, with_bias):
    generator = torch.Generator().manual_seed(out_features)
    weight = (torch.randn(out_features, 96, generator=generator) / 8).bfloat16()
    bias = torch.randn(out_features, generator=generator).bfloat16() if with_bias else None
    x = torch.randn(101, 96, generator=generator).bfloat16()
    layer = ReplicatedLinear(96, out_features, bias=with_bias, params_dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
    whole = dense.linear(layer, x)
    assert whole.shape == (101, out_features) and whole.dtype == torch.bfloat16
    # float32 sums against exact ones: within a unit or two of bf16's last place.
    torch.testing.assert_close(whole, _exact(x, weight, bias), rtol=2e-2, atol=2e-2)
    # A row's result does not depend on the call's other rows (1, 7 or 101 rows: other row
    # blocks, chunks and tile groups), bit for bit.
    for rows in (slice(0, 1), slice(3, 10), slice(50, 101)):
        assert torch.equal(dense.linear(layer, x[rows].contiguous()), whole[rows])


@needs_kernel
def test_kernel_rounds_like_torch_on_exact_sums():
    # Sums of small integers are exact in float32, so the only rounding is the final one, which
    # must be round-to-nearest-even as torch's .to(bfloat16).
    generator = torch.Generator().manual_seed(3)
    weight = torch.randint(-8, 8, (48, 64), generator=generator).bfloat16()
    x = torch.randint(-8, 8, (5, 64), generator=generator).bfloat16()
    bias = torch.randint(-300, 300, (48,), generator=generator).bfloat16()
    layer = ReplicatedLinear(64, 48, bias=True, params_dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)
    assert torch.equal(dense.linear(layer, x), _exact(x, weight, bias))


def test_lm_head_runs_the_dense_product(product):
    from kiln.model_executor.layers.vocab_embedding import LogitsProcessor, ParallelLMHead

    assert dense.register_dense_ops()
    generator = torch.Generator().manual_seed(5)
    head = ParallelLMHead(120, 64, params_dtype=torch.bfloat16)
    with torch.no_grad():
        head.weight.copy_(torch.randn(120, 64, generator=generator))
    op = LogitsProcessor(100, scale=0.5)
    hidden = torch.randn(3, 64, generator=generator).bfloat16()
    assert dense._logits_supports(op, head, hidden)
    logits = dense.logits(op, head, hidden)
    assert logits.shape == (3, 100) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, op.forward_native(head, hidden), rtol=1e-2, atol=1e-2)


def test_dense_linear_leaves_float32_and_batch_invariant_layers(layer):
    x32 = torch.randn(2, 192)
    assert not dense._linear_supports(layer, x32)
    layer32 = ReplicatedLinear(192, 320, params_dtype=torch.float32)
    assert not dense._linear_supports(layer32, x32)
    invariant = ReplicatedLinear(192, 320, params_dtype=torch.bfloat16)
    invariant.batch_invariant = True  # what batch-invariant mode sets on every linear
    assert not dense._linear_supports(invariant, x32.bfloat16())


def test_amx_cpus_keep_onednn(monkeypatch):
    # oneDNN multiplies with AMX tiles there; the kernel was not measured against it.
    monkeypatch.setattr(dense, "cpu_flags", lambda: frozenset({"avx512_bf16", "amx_bf16"}))
    dense._kernel.cache_clear()
    try:
        assert not dense.kernel_available()
    finally:
        monkeypatch.undo()
        dense._kernel.cache_clear()
    assert dense.kernel_available() == hasattr(dense.load_dense_kernels(), "linear")
