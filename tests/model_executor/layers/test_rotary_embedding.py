"""RotaryEmbedding against transformers' rope init functions and apply_rotary_pos_emb."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from kiln.model_executor.layers.rotary_embedding import RotaryEmbedding, rope_inv_freq

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
SCALINGS = [None, {"rope_type": "linear", "factor": 4.0}, LLAMA3]


def _hf_config(head_dim: int, base: float, scaling: dict | None, max_pos: int) -> LlamaConfig:
    params = {"rope_type": "default", "rope_theta": base, **(scaling or {})}
    return LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rope_parameters=params,
    )


@pytest.mark.parametrize("scaling", SCALINGS, ids=["default", "linear", "llama3"])
def test_inv_freq_matches_transformers(scaling: dict | None) -> None:
    config = _hf_config(64, 500000.0, scaling, 1024)
    if scaling is None:
        expected, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu")
    torch.testing.assert_close(rope_inv_freq(64, 500000.0, scaling), expected, rtol=0, atol=0)


@pytest.mark.parametrize("scaling", SCALINGS, ids=["default", "linear", "llama3"])
def test_rotary_matches_hf_apply_rotary_pos_emb(scaling: dict | None) -> None:
    head_dim, num_heads, num_kv_heads, max_pos = 32, 4, 2, 512
    config = _hf_config(head_dim, 10000.0, scaling, max_pos)
    hf_rope = LlamaRotaryEmbedding(config)
    rope = RotaryEmbedding(head_dim, max_pos, 10000.0, scaling, torch.float32)

    gen = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 1, 2, 100, 7, 300, 511])  # out of order: a flattened batch
    q = torch.randn(len(positions), num_heads * head_dim, generator=gen)
    k = torch.randn(len(positions), num_kv_heads * head_dim, generator=gen)
    q_out, k_out = rope.forward_native(positions, q, k)

    cos, sin = hf_rope(q, positions[None, :])  # [1, T, D]
    # HF layout [batch, heads, T, D]
    q_hf = q.view(1, -1, num_heads, head_dim).transpose(1, 2)
    k_hf = k.view(1, -1, num_kv_heads, head_dim).transpose(1, 2)
    q_ref, k_ref = apply_rotary_pos_emb(q_hf, k_hf, cos, sin)
    q_ref = q_ref.transpose(1, 2).reshape(len(positions), -1)
    k_ref = k_ref.transpose(1, 2).reshape(len(positions), -1)
    assert q_out.shape == q.shape and k_out.shape == k.shape
    torch.testing.assert_close(q_out, q_ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(k_out, k_ref, rtol=0, atol=1e-6)


def test_rotary_accepts_strided_views_and_keeps_inputs() -> None:
    # Models pass q and k as column slices of the fused qkv output.
    rope = RotaryEmbedding(16, 64, 10000.0)
    qkv = torch.randn(5, (4 + 2 + 2) * 16)
    q, k, _ = qkv.split([64, 32, 32], dim=-1)
    before = qkv.clone()
    q_out, k_out = rope(torch.arange(5), q, k)
    q_ref, k_ref = rope(torch.arange(5), q.contiguous(), k.contiguous())
    torch.testing.assert_close(q_out, q_ref, rtol=0, atol=0)
    torch.testing.assert_close(k_out, k_ref, rtol=0, atol=0)
    torch.testing.assert_close(qkv, before, rtol=0, atol=0)


def test_rotary_position_zero_is_identity_and_norm_is_kept() -> None:
    rope = RotaryEmbedding(8, 16, 10000.0)
    q, k = torch.randn(2, 16), torch.randn(2, 8)
    q_out, k_out = rope(torch.tensor([0, 9]), q, k)
    torch.testing.assert_close(q_out[0], q[0])
    # A rotation keeps each (i, i + D/2) pair's norm.
    pairs = lambda x: x.view(-1, 2, 4).pow(2).sum(1)  # noqa: E731
    torch.testing.assert_close(pairs(q_out[1]), pairs(q[1]), rtol=1e-5, atol=1e-5)


def test_unsupported_rope_type_is_refused() -> None:
    with pytest.raises(ValueError, match="yarn"):
        RotaryEmbedding(16, 32, 10000.0, {"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="low_freq_factor"):
        RotaryEmbedding(16, 32, 10000.0, {"rope_type": "llama3", "factor": 2.0})
