"""RMSNorm against Hugging Face's LlamaRMSNorm, with and without the fused residual add."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from kiln.model_executor.layers.layernorm import RMSNorm


def _pair(hidden: int, eps: float, dtype: torch.dtype) -> tuple[RMSNorm, LlamaRMSNorm]:
    weight = torch.randn(hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
    ours = RMSNorm(hidden, eps, dtype)
    ours.weight.data.copy_(weight)
    ref = LlamaRMSNorm(hidden, eps).to(dtype)
    ref.weight.data.copy_(weight)
    return ours, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_hf(dtype: torch.dtype) -> None:
    ours, ref = _pair(96, 1e-5, dtype)
    x = (torch.randn(7, 96, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    out = ours.forward_native(x)
    assert out.dtype == dtype
    # Same operations in the same order: bitwise equal.
    torch.testing.assert_close(out, ref(x), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_fused_residual(dtype: torch.dtype) -> None:
    ours, ref = _pair(64, 1e-6, dtype)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 64, generator=gen).to(dtype)
    residual = torch.randn(5, 64, generator=gen).to(dtype)
    out, new_residual = ours(x, residual)
    torch.testing.assert_close(new_residual, x + residual, rtol=0, atol=0)
    torch.testing.assert_close(out, ref(x + residual), rtol=0, atol=0)
    # Inputs are not modified in place.
    assert not torch.equal(new_residual, residual)


def test_rms_norm_normalizes_last_dim_of_3d() -> None:
    # Qwen3 applies it per head: [T, H, D].
    ours, ref = _pair(16, 1e-6, torch.float32)
    x = torch.randn(3, 4, 16)
    torch.testing.assert_close(ours(x), ref(x), rtol=0, atol=0)
    norms = (ours(x) / ours.weight).pow(2).mean(-1)
    torch.testing.assert_close(norms, torch.ones(3, 4), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_rms_norm_matches_hf_bitwise(dtype: torch.dtype) -> None:
    # (1 + w), statistics and scale in float32, one rounding: Gemma2RMSNorm's arithmetic.
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    from kiln.model_executor.layers.layernorm import GemmaRMSNorm

    gen = torch.Generator().manual_seed(3)
    weight = (0.3 * torch.randn(64, generator=gen)).to(dtype)
    ours, ref = GemmaRMSNorm(64, 1e-6, dtype), Gemma2RMSNorm(64, 1e-6).to(dtype)
    assert bool((ours.weight == 0).all())  # a scale of 1 before loading, as the checkpoints'
    ours.weight.data.copy_(weight)
    ref.weight.data.copy_(weight)
    x = (3 * torch.randn(5, 64, generator=gen)).to(dtype)
    residual = torch.randn(5, 64, generator=gen).to(dtype)
    torch.testing.assert_close(ours(x), ref(x), rtol=0, atol=0)
    out, new_residual = ours(x, residual)
    torch.testing.assert_close(new_residual, x + residual, rtol=0, atol=0)
    torch.testing.assert_close(out, ref(x + residual), rtol=0, atol=0)
