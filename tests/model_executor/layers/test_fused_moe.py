"""The ``fused_moe`` op's reference against a dense all-experts float64 computation (every expert
applied to every token, weighted by a routing mask computed here from the definition), for softmax
and sigmoid scoring, renormalization on and off, top-1 and top-2; the layer's weight loader
(per-expert and stacked tensors, a tensor-parallel rank's slice); shared experts; the capture
form; bad arguments."""

from __future__ import annotations

from typing import Any, cast

import pytest
import torch
import torch.nn.functional as F

from kiln.distributed.parallel_state import TensorParallelGroup, set_tp_group
from kiln.model_executor.custom_op import OP_REGISTRY
from kiln.model_executor.layers.fused_moe import FusedMoE, expert_shard

E, H, INTER = 6, 32, 24


@pytest.fixture(autouse=True)
def reference_dispatch():
    """These tests check the reference: a platform an earlier test in this process selected
    (kiln-x86's kernel, checked against this reference in its own tests) is set aside."""
    before = OP_REGISTRY.device_type
    OP_REGISTRY.select_device(None)
    yield
    OP_REGISTRY.select_device(before)


def dense_reference(x, logits, w13, w2, top_k, renormalize, scoring) -> torch.Tensor:
    """Every expert on every token in float64, summed with weights that are zero outside each
    token's top-k scores: the definition, with nothing skipped."""
    x, logits, w13, w2 = (t.double() for t in (x, logits, w13, w2))
    scores = logits.softmax(-1) if scoring == "softmax" else logits.sigmoid()  # [T, E]
    # Ranks by sorting each row: the top_k highest scores get their score, the rest zero.
    order = scores.argsort(dim=-1, descending=True)
    mask = torch.zeros_like(scores).scatter_(1, order[:, :top_k], 1.0)
    weights = scores * mask
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    gate_up = torch.einsum("th,eoh->teo", x, w13)  # [T, E, 2I]
    act = F.silu(gate_up[..., :INTER]) * gate_up[..., INTER:]
    y = torch.einsum("tei,ehi->teh", act, w2)  # [T, E, H]
    return (weights[..., None] * y).sum(1)


def make_layer(top_k, renormalize, scoring, dtype=torch.float32, seed=0) -> FusedMoE:
    layer = FusedMoE(
        E, top_k, H, INTER, renormalize=renormalize, scoring_func=scoring, params_dtype=dtype
    )
    gen = torch.Generator().manual_seed(seed)
    for param in layer.parameters():
        param.data.copy_(0.3 * torch.randn(param.shape, generator=gen))
    return layer


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "no-renorm"])
@pytest.mark.parametrize("top_k", [1, 2])
def test_reference_equals_dense_all_experts_float64(scoring, renormalize, top_k) -> None:
    layer = make_layer(top_k, renormalize, scoring)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(11, H, generator=gen)
    logits = 2 * torch.randn(11, E, generator=gen)
    got = layer(x, logits)
    want = dense_reference(
        x, logits, layer.w13_weight, layer.w2_weight, top_k, renormalize, scoring
    )
    assert got.dtype == torch.float32 and got.shape == (11, H)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_bfloat16_is_close_to_float64() -> None:
    layer = make_layer(2, True, "softmax", torch.bfloat16)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, H, generator=gen).bfloat16()
    logits = torch.randn(5, E, generator=gen).bfloat16()
    got = layer(x, logits)
    assert got.dtype == torch.bfloat16
    want = dense_reference(x, logits, layer.w13_weight, layer.w2_weight, 2, True, "softmax")
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)


def test_only_the_routed_experts_weights_are_read() -> None:
    layer = make_layer(2, True, "softmax")
    x = torch.randn(3, H)
    logits = torch.full((3, E), -30.0)
    logits[:, 1], logits[:, 4] = 5.0, 4.0  # every token: experts 1 and 4
    want = layer(x, logits)
    for expert in (0, 2, 3, 5):
        layer.w13_weight.data[expert] = float("nan")
        layer.w2_weight.data[expert] = float("nan")
    torch.testing.assert_close(layer(x, logits), want, rtol=0, atol=0)


def test_capture_form_is_the_library_op_and_equals_eager() -> None:
    layer = make_layer(2, False, "sigmoid")
    x, logits = torch.randn(4, H), torch.randn(4, E)
    traced = torch.jit.trace(
        lambda x, logits: layer.forward_native(x, logits), (x, logits), check_trace=False
    )
    assert "kiln::fused_moe" in str(traced.graph)
    # Another routing than the one traced: the graph must not have frozen the expert loop.
    x2, logits2 = torch.randn(4, H), torch.randn(4, E)
    torch.testing.assert_close(traced(x2, logits2), layer(x2, logits2), rtol=0, atol=0)


def test_shared_experts_are_added_to_the_routed_sum() -> None:
    shared = torch.nn.Linear(H, H, bias=False)
    layer = make_layer(2, True, "softmax")
    with_shared = FusedMoE(E, 2, H, INTER, shared_experts=shared)
    with_shared.load_state_dict(layer.state_dict(), strict=False)
    x, logits = torch.randn(4, H), torch.randn(4, E)
    with torch.no_grad():
        torch.testing.assert_close(with_shared(x, logits), layer(x, logits) + shared(x))


def test_weight_loader_per_expert_and_stacked_and_one_rank_of_two() -> None:
    gen = torch.Generator().manual_seed(3)
    gate, up = torch.randn(E, INTER, H, generator=gen), torch.randn(E, INTER, H, generator=gen)
    down = torch.randn(E, H, INTER, generator=gen)
    per_expert = FusedMoE(E, 2, H, INTER)
    for e in range(E):
        for tensor, part in ((gate[e], "gate"), (up[e], "up")):
            per_expert.weight_loader(per_expert.w13_weight, tensor, (e, part))
        per_expert.weight_loader(per_expert.w2_weight, down[e], (e, "down"))
    assert torch.equal(per_expert.w13_weight, torch.cat([gate, up], dim=1))
    assert torch.equal(per_expert.w2_weight, down)
    stacked = FusedMoE(E, 2, H, INTER)
    stacked.weight_loader(stacked.w13_weight, torch.cat([gate, up], dim=1), (None, "gate_up"))
    stacked.weight_loader(stacked.w2_weight, down, (None, "down"))
    assert torch.equal(stacked.w13_weight, per_expert.w13_weight)
    assert torch.equal(stacked.w2_weight, per_expert.w2_weight)
    half = INTER // 2
    # Only the loader runs here (no collective): any object stands in for the communicator.
    group = TensorParallelGroup(rank=1, world_size=2, communicator=cast(Any, object()))
    with set_tp_group(group):
        rank1 = FusedMoE(E, 2, H, INTER)
    rank1.weight_loader(rank1.w13_weight, torch.cat([gate, up], dim=1), (None, "gate_up"))
    rank1.weight_loader(rank1.w2_weight, down[2], (2, "down"))
    assert torch.equal(rank1.w13_weight, torch.cat([gate[:, half:], up[:, half:]], dim=1))
    assert torch.equal(rank1.w2_weight[2], down[2][:, half:])


def test_expert_shard_maps_checkpoint_names() -> None:
    mixtral = {"w1": "gate", "w3": "up", "w2": "down"}
    assert expert_shard("model.layers.3.mlp.experts.7.w3.weight", mixtral) == (
        "model.layers.3.mlp.experts.w13_weight",
        (7, "up"),
    )
    assert expert_shard("m.experts.down_proj", {}) == ("m.experts.w2_weight", (None, "down"))
    assert expert_shard("model.layers.0.mlp.gate_proj.weight", {"gate_proj": "gate"}) is None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"scoring_func": "relu"}, "scoring_func"),
        ({"top_k": 7}, "top_k"),
    ],
)
def test_bad_arguments_are_refused(kwargs, match) -> None:
    args = {"num_experts": E, "top_k": 2, "hidden_size": H, "intermediate_size": INTER, **kwargs}
    with pytest.raises(ValueError, match=match):
        FusedMoE(**args)


def test_a_misplaced_or_misshaped_tensor_is_refused() -> None:
    layer = FusedMoE(E, 2, H, INTER)
    with pytest.raises(ValueError, match="part 'down' does not load here"):
        layer.weight_loader(layer.w13_weight, torch.zeros(H, INTER), (0, "down"))
    with pytest.raises(ValueError, match="does not fit"):
        layer.weight_loader(layer.w13_weight, torch.zeros(INTER + 1, H), (0, "gate"))
    with pytest.raises(ValueError, match="out of range"):
        layer.weight_loader(layer.w13_weight, torch.zeros(INTER, H), (E, "gate"))


def test_op_is_registered_with_examples() -> None:
    assert OP_REGISTRY.ops.get("fused_moe") is FusedMoE
    examples = FusedMoE.make_examples(torch.Generator().manual_seed(0))
    for op, args, kwargs in examples:
        want = op.forward_native(*args, **kwargs)
        assert torch.isfinite(want.float()).all()
        if op.tp_size == 1:  # a rank's example has no communicator for its layer's all-reduce
            torch.testing.assert_close(op(*args, **kwargs), want)
    # One is a rank's local experts under expert parallelism, for the conformance kit.
    assert any(op.expert_offset > 0 for op, _, _ in examples)
