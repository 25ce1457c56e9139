"""``kiln_x86.dense``: a dense bf16 linear runs oneDNN's packed product eagerly, and a trace
records it as one ``kiln_x86_dense::linear`` call on the plain weight that replays the same
rows (the packed weight itself cannot be a trace's constant)."""

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


def test_traced_dense_linear_records_one_op_and_replays_the_eager_rows(layer):
    x = torch.randn(4, 192, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
    assert dense._linear_supports(layer, x)
    eager = dense.linear(layer, x)
    torch.testing.assert_close(eager, F.linear(x, layer.weight, layer.bias), rtol=0.02, atol=0.02)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = torch.jit.trace(lambda x: dense.linear(layer, x), (x,), check_trace=False)
    kinds = [node.kind() for node in graph.graph.nodes()]
    assert kinds.count("kiln_x86_dense::linear") == 1, graph.graph
    assert not [kind for kind in kinds if kind.startswith("mkldnn::")], graph.graph
    assert torch.equal(graph(x), eager)


def test_dense_linear_leaves_float32_and_batch_invariant_layers(layer):
    x32 = torch.randn(2, 192)
    assert not dense._linear_supports(layer, x32)
    layer32 = ReplicatedLinear(192, 320, params_dtype=torch.float32)
    assert not dense._linear_supports(layer32, x32)
    invariant = ReplicatedLinear(192, 320, params_dtype=torch.bfloat16)
    invariant.batch_invariant = True  # what batch-invariant mode sets on every linear
    assert not dense._linear_supports(invariant, x32.bfloat16())
