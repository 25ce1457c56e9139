"""Linear layers: fused shard loading, the quantization hook, and shape/shard errors."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kiln.model_executor.layers.linear import (
    LinearBase,
    LinearMethodBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    QuantizationConfig,
    ReplicatedLinear,
    RowParallelLinear,
    set_weight_attrs,
)


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_replicated_linear_is_f_linear() -> None:
    layer = ReplicatedLinear(8, 5, bias=True)
    w, b = _randn(5, 8, seed=1), _randn(5, seed=2)
    layer.weight.weight_loader(layer.weight, w)
    layer.bias.weight_loader(layer.bias, b)
    x = _randn(3, 8)
    torch.testing.assert_close(layer(x), F.linear(x, w, b), rtol=0, atol=0)


def test_qkv_shards_fuse_three_projections() -> None:
    hidden, head_dim, heads, kv_heads = 16, 4, 4, 2
    layer = QKVParallelLinear(hidden, head_dim, heads, kv_heads, bias=True)
    assert layer.weight.shape == ((heads + 2 * kv_heads) * head_dim, hidden)
    weights = {
        s: _randn(n * head_dim, hidden, seed=i)
        for i, (s, n) in enumerate([("q", heads), ("k", kv_heads), ("v", kv_heads)])
    }
    biases = {s: _randn(w.shape[0], seed=10 + i) for i, (s, w) in enumerate(weights.items())}
    for shard in ("v", "q", "k"):  # any order
        layer.weight.weight_loader(layer.weight, weights[shard], shard)
        layer.bias.weight_loader(layer.bias, biases[shard], shard)
    x = _randn(3, hidden, seed=20)
    q, k, v = layer(x).split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    for name, out in (("q", q), ("k", k), ("v", v)):
        torch.testing.assert_close(out, F.linear(x, weights[name], biases[name]))


def test_merged_column_shards_gate_then_up() -> None:
    layer = MergedColumnParallelLinear(6, [10, 10])
    gate, up = _randn(10, 6, seed=1), _randn(10, 6, seed=2)
    layer.weight.weight_loader(layer.weight, up, 1)
    layer.weight.weight_loader(layer.weight, gate, 0)
    x = _randn(2, 6)
    torch.testing.assert_close(layer(x), torch.cat([x @ gate.T, x @ up.T], -1))


def test_shard_errors_are_clear() -> None:
    layer = QKVParallelLinear(16, 4, 4, 2, prefix="model.layers.0.self_attn.qkv_proj")
    with pytest.raises(ValueError, match="shard_id must be 'q', 'k' or 'v'"):
        layer.weight.weight_loader(layer.weight, torch.zeros(8, 16), "x")
    with pytest.raises(ValueError, match="does not fit"):
        layer.weight.weight_loader(layer.weight, torch.zeros(16, 16), "k")
    merged = MergedColumnParallelLinear(4, [3, 3])
    with pytest.raises(ValueError, match="shard_id must be in range"):
        merged.weight.weight_loader(merged.weight, torch.zeros(3, 4), 2)
    plain = RowParallelLinear(4, 3)
    with pytest.raises(ValueError, match="does not fit"):
        plain.weight.weight_loader(plain.weight, torch.zeros(4, 3))
    # Outside a tensor-parallel group (kiln.distributed.parallel_state) there is one rank.
    with pytest.raises(ValueError, match="tp_size=2 differs .* allowed: None or 1"):
        RowParallelLinear(4, 3, tp_size=2)


def test_every_linear_layer_is_the_linear_op() -> None:
    for cls in (ReplicatedLinear, QKVParallelLinear, MergedColumnParallelLinear, RowParallelLinear):
        assert issubclass(cls, LinearBase) and cls.op_name == "linear"


class Int8Method(LinearMethodBase):
    """A toy weight-only int8 method: what a quantization plugin would supply."""

    def create_weights(
        self,
        layer: nn.Module,
        input_size: int,
        output_partition_sizes: Sequence[int],
        params_dtype: torch.dtype,
        weight_loader,
    ) -> None:
        qweight = nn.Parameter(
            torch.empty(sum(output_partition_sizes), input_size, dtype=torch.int8),
            requires_grad=False,
        )
        scale = nn.Parameter(torch.empty(sum(output_partition_sizes), 1), requires_grad=False)

        # The layer's own loader places fused shards; quantize on the way in.
        def load(param, loaded, shard_id=None):
            s = loaded.abs().amax(-1, keepdim=True) / 127
            weight_loader(qweight, torch.round(loaded / s).to(torch.int8), shard_id)
            weight_loader(scale, s, shard_id)

        set_weight_attrs(qweight, {"weight_loader": load, "output_dim": 0})
        set_weight_attrs(scale, {"weight_loader": lambda *a: None, "output_dim": 0})
        layer.register_parameter("qweight", qweight)
        layer.register_parameter("scale", scale)
        self.processed = False

    def apply(self, layer, x, bias=None):
        return F.linear(x, layer.qweight.float() * layer.scale, bias)

    def process_weights_after_loading(self, layer) -> None:
        self.processed = True


class Int8Config(QuantizationConfig):
    def __init__(self) -> None:
        self.seen: list[str] = []

    def get_linear_method(self, layer, prefix):
        self.seen.append(prefix)
        return Int8Method() if prefix.endswith("gate_up_proj") else None


def test_quant_config_supplies_method_per_layer() -> None:
    config = Int8Config()
    quantized = MergedColumnParallelLinear(
        8, [4, 4], quant_config=config, prefix="mlp.gate_up_proj"
    )
    dense = RowParallelLinear(8, 4, quant_config=config, prefix="mlp.down_proj")
    assert config.seen == ["mlp.gate_up_proj", "mlp.down_proj"]
    assert isinstance(quantized.quant_method, Int8Method) and not hasattr(quantized, "weight")
    assert quantized.qweight.dtype == torch.int8 and hasattr(dense, "weight")

    gate, up = _randn(4, 8, seed=1), _randn(4, 8, seed=2)
    quantized.qweight.weight_loader(quantized.qweight, gate, 0)
    quantized.qweight.weight_loader(quantized.qweight, up, 1)
    x = _randn(3, 8)
    expected = torch.cat([x @ gate.T, x @ up.T], -1)
    # int8 weights: within quantization error of the dense product.
    torch.testing.assert_close(quantized(x), expected, rtol=0.05, atol=0.05)
    assert not torch.equal(quantized(x), expected)
