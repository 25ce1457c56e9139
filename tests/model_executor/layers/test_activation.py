"""SiluAndMul against the formula and Hugging Face's LlamaMLP arithmetic."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.model_executor.layers.activation import SiluAndMul


def test_silu_and_mul_formula() -> None:
    x = torch.randn(6, 2 * 40, generator=torch.Generator().manual_seed(0))
    gate, up = x[:, :40], x[:, 40:]
    expected = gate / (1 + torch.exp(-gate)) * up
    out = SiluAndMul().forward_native(x)
    assert out.shape == (6, 40)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


def test_silu_and_mul_matches_separate_projections() -> None:
    # HF's MLP: down(act(gate(x)) * up(x)); ours runs one fused [gate; up] projection first.
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(4, 16, generator=gen)
    w_gate, w_up = torch.randn(32, 16, generator=gen), torch.randn(32, 16, generator=gen)
    fused = F.linear(hidden, torch.cat([w_gate, w_up]))
    expected = F.silu(F.linear(hidden, w_gate)) * F.linear(hidden, w_up)
    torch.testing.assert_close(SiluAndMul()(fused), expected, rtol=1e-5, atol=1e-5)
    assert fused.shape == (4, 64)  # input untouched


@pytest.mark.parametrize(
    ("approximate", "hf_name"), [("tanh", "gelu_pytorch_tanh"), ("none", "gelu")]
)
def test_gelu_and_mul_matches_hf_activation(approximate: str, hf_name: str) -> None:
    from transformers.activations import ACT2FN

    from kiln.model_executor.layers.activation import GeluAndMul

    x = (3 * torch.randn(6, 2 * 40, generator=torch.Generator().manual_seed(2))).bfloat16()
    expected = ACT2FN[hf_name](x[:, :40]) * x[:, 40:]
    torch.testing.assert_close(GeluAndMul(approximate)(x), expected, rtol=0, atol=0)


def test_gelu_and_mul_refuses_another_approximation() -> None:
    from kiln.model_executor.layers.activation import GeluAndMul

    with pytest.raises(ValueError, match="approximate"):
        GeluAndMul("erf")
