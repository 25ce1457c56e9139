"""kiln-x86's ``fused_moe`` kernel against Kiln's reference (``forward_native``) and, in
bfloat16, against a float64 computation: softmax and sigmoid routing, renormalization on and off,
top-1 and top-2 of 8 experts, 1 to 32 tokens, an expert no token chose and one that every token
chose; a rank's local experts under expert parallelism (tokens routed elsewhere contribute
nothing, the other experts' weights are not held); only the routed experts' weights are read;
the routing (decode sizes to the kernel,
prefills to the reference); the kernel's dispatcher op in a trace."""

from typing import Any, cast

import pytest
import torch
from kiln_x86 import moe

from kiln.distributed.parallel_state import TensorParallelGroup, set_tp_group
from kiln.model_executor.layers.fused_moe import FusedMoE, fused_moe_reference

pytestmark = pytest.mark.plugin

E, H, INTER = 8, 88, 40  # H and INTER not multiples of the kernel's 16 or 32 lanes or row blocks


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if not moe.register_x86_moe():
        pytest.fail("kiln-x86's MoE kernel could not be built here (see the log)")


def make_layer(top_k, renormalize, scoring, dtype, seed=0, ep_rank=None) -> FusedMoE:
    """A layer with random weights; with ``ep_rank``, that rank of two's under expert
    parallelism (only construction: any object stands in for the communicator)."""
    group = (
        TensorParallelGroup()
        if ep_rank is None
        else TensorParallelGroup(rank=ep_rank, world_size=2, communicator=cast(Any, object()))
    )
    with set_tp_group(group):
        layer = FusedMoE(
            E,
            top_k,
            H,
            INTER,
            renormalize=renormalize,
            scoring_func=scoring,
            params_dtype=dtype,
            expert_parallel=ep_rank is not None,
        )
    g = torch.Generator().manual_seed(seed)
    for param in layer.parameters():
        param.data.copy_((torch.randn(param.shape, generator=g) / H**0.5).to(dtype))
    return layer


def inputs(num_tokens, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, H, generator=g).to(dtype)
    logits = (2 * torch.randn(num_tokens, E, generator=g)).to(dtype)
    return x, logits


@pytest.mark.parametrize("num_tokens", [1, 3, 16, 32])
@pytest.mark.parametrize(
    "top_k, renormalize, scoring",
    [(2, True, "softmax"), (2, False, "softmax"), (1, False, "sigmoid"), (2, True, "sigmoid")],
)
def test_float32_kernel_matches_the_reference(num_tokens, top_k, renormalize, scoring):
    layer = make_layer(top_k, renormalize, scoring, torch.float32)
    x, logits = inputs(num_tokens, torch.float32)
    got = moe.fused_moe(layer, x, logits)
    torch.testing.assert_close(got, layer.forward_native(x, logits), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("num_tokens", [1, 16])
def test_bfloat16_kernel_is_as_close_to_float64_as_the_reference(num_tokens):
    layer = make_layer(2, True, "softmax", torch.bfloat16)
    x, logits = inputs(num_tokens, torch.bfloat16)
    exact = fused_moe_reference(
        x.double(),
        logits.double(),
        layer.w13_weight.double(),
        layer.w2_weight.double(),
        2,
        True,
        "softmax",
    )
    got = moe.fused_moe(layer, x, logits)
    assert got.dtype == torch.bfloat16
    reference_error = (layer.forward_native(x, logits).double() - exact).abs().max()
    kernel_error = (got.double() - exact).abs().max()
    assert kernel_error <= reference_error
    torch.testing.assert_close(got.double(), exact, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("ep_rank", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_ranks_local_experts_match_the_reference(ep_rank, dtype):
    layer = make_layer(2, True, "softmax", dtype, ep_rank=ep_rank)
    assert (layer.w13_weight.shape[0], layer.expert_offset) == (E // 2, E // 2 * ep_rank)
    x, logits = inputs(16, dtype)
    got, want = moe.fused_moe(layer, x, logits), layer.forward_native(x, logits)
    # bfloat16: the reference rounds each matmul, the kernel not (see the float64 test).
    tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got, want, **tolerance)
    assert (got == 0).all(dim=-1).any()  # a token whose experts are both the other rank's


def test_only_the_routed_experts_weights_are_read():
    layer = make_layer(2, True, "softmax", torch.float32)
    x, _ = inputs(5, torch.float32)
    logits = torch.full((5, E), -20.0)
    logits[:, 6], logits[:, 2] = 3.0, 2.0  # every token: experts 6 and 2
    logits[0, 2], logits[0, 5] = -20.0, 2.5  # token 0: 6 and 5
    want = layer.forward_native(x, logits)
    for expert in (0, 1, 3, 4, 7):
        layer.w13_weight.data[expert] = float("nan")
        layer.w2_weight.data[expert] = float("nan")
    torch.testing.assert_close(moe.fused_moe(layer, x, logits), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_sizes_go_to_the_kernel_and_prefills_to_the_reference(dtype):
    layer = make_layer(2, True, "softmax", dtype)
    small, _ = inputs(moe.MOE_MAX_TOKENS[dtype], dtype)
    large, _ = inputs(moe.MOE_MAX_TOKENS[dtype] + 1, dtype)
    assert moe._supports(layer, small, small[:, :E])
    assert not moe._supports(layer, large, large[:, :E])
    assert not moe._supports(layer, small.half(), small[:, :E])


def test_a_trace_records_the_kernels_dispatcher_op():
    layer = make_layer(2, True, "softmax", torch.float32)
    x, logits = inputs(4, torch.float32)
    traced = torch.jit.trace(
        lambda x, logits: moe.fused_moe(layer, x, logits), (x, logits), check_trace=False
    )
    assert "kiln_x86_moe::fused_moe" in str(traced.graph)
    x2, logits2 = inputs(4, torch.float32, seed=7)  # another routing than the traced one
    torch.testing.assert_close(traced(x2, logits2), layer.forward_native(x2, logits2))
