"""Rotary position embedding (RoPE), neox style, with a cos/sin cache computed once.

Contract: ``RotaryEmbedding(head_dim, max_position, base, rope_scaling)(positions, q, k)`` rotates
every head of ``q`` [num_tokens, num_heads * head_dim] and ``k`` [num_tokens, num_kv_heads *
head_dim] by its token's position, pairing dimension ``i`` with ``i + head_dim / 2`` (the Hugging
Face Llama layout, "rotate half"). The result equals Hugging Face's ``apply_rotary_pos_emb`` with
the inverse frequencies of its rope init functions: ``default``, ``linear`` and ``llama3``
scaling are supported; any other ``rope_type`` is refused at construction.

``cos_sin_cache`` [max_position, head_dim] (cos in the first half, sin in the second) is a
non-persistent buffer; one instance can be shared by every layer of a model. This module knows
nothing about models or configs beyond the ``rope_scaling`` dict.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kiln.model_executor.custom_op import CustomOp, register_op

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_inv_freq(
    head_dim: int, base: float, rope_scaling: dict[str, Any] | None = None
) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies, scaled as ``rope_scaling`` says.

    Raises:
        ValueError: an unsupported ``rope_type`` or a missing scaling parameter.
    """
    # Same arithmetic as transformers' rope init functions, so the cache matches bit for bit.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (base**exponents)
    rope_type = _rope_type(rope_scaling)
    if rope_type == "default":
        return inv_freq
    assert rope_scaling is not None
    try:
        factor = float(rope_scaling["factor"])
        if rope_type == "linear":
            return inv_freq / factor
        low = float(rope_scaling["low_freq_factor"])
        high = float(rope_scaling["high_freq_factor"])
        original = float(rope_scaling["original_max_position_embeddings"])
    except KeyError as exc:
        raise ValueError(f"rope_scaling {rope_scaling} lacks {exc.args[0]!r}") from None
    # llama3: keep short wavelengths, divide long ones by factor, blend in between.
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < original / high) * ~(wavelen > original / low)
    return torch.where(is_medium, blended, scaled)


def _rope_type(rope_scaling: dict[str, Any] | None) -> str:
    if not rope_scaling:
        return "default"
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_scaling rope_type={rope_type!r} is not supported; supported: "
            f"{list(SUPPORTED_ROPE_TYPES)}"
        )
    return rope_type


@register_op("rotary_embedding")
class RotaryEmbedding(CustomOp):
    """Neox-style rotary embedding over whole heads.

    Args:
        head_dim: dimension of each head (all of it is rotated).
        max_position: positions ``0 .. max_position - 1`` are cached; larger ones are an error.
        base: rope theta.
        rope_scaling: Hugging Face ``rope_scaling`` (or ``rope_parameters``) dict, or None.
        dtype: dtype of the cache (the model's compute dtype; Hugging Face also rounds cos/sin
            to it).
    """

    cos_sin_cache: torch.Tensor
    """Buffer (register_buffer) [max_position, head_dim]: cos then sin of each position."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float = 10000.0,
        rope_scaling: dict[str, Any] | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embedding, got {head_dim}")
        self.head_dim = head_dim
        self.max_position = max_position
        self.base = base
        self.rope_scaling = rope_scaling
        inv_freq = rope_inv_freq(head_dim, base, rope_scaling)  # [head_dim / 2]
        positions = torch.arange(max_position, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq[None, :]  # [max_position, head_dim / 2]
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # [max_position, head_dim]
        self.register_buffer(
            "cos_sin_cache", cache.to(dtype or torch.get_default_dtype()), persistent=False
        )

    def forward_native(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` [T] int; ``query`` [T, H * D]; ``key`` [T, Hkv * D] -> rotated copies."""
        num_tokens = positions.shape[0]
        cos_sin = self.cos_sin_cache.index_select(0, positions)  # [T, D]
        cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)  # each [T, 1, D / 2]
        query = _rotate(query.view(num_tokens, -1, self.head_dim), cos, sin)
        key = _rotate(key.view(num_tokens, -1, self.head_dim), cos, sin)
        return query.view(num_tokens, -1), key.view(num_tokens, -1)

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, max_position={self.max_position}, base={self.base}, "
            f"rope_scaling={self.rope_scaling}"
        )

    @classmethod
    def make_examples(cls, generator: torch.Generator) -> list[tuple[CustomOp, tuple, dict]]:
        llama3 = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        }
        positions = torch.randint(0, 1024, (6,), generator=generator)
        q = torch.randn(6, 4 * 64, generator=generator)
        k = torch.randn(6, 2 * 64, generator=generator)
        return [
            (cls(64, 1024, 10000.0), (positions, q, k), {}),
            (cls(64, 1024, 500000.0, llama3), (positions, q, k), {}),
            (
                cls(64, 1024, 10000.0, dtype=torch.bfloat16),
                (positions, q.bfloat16(), k.bfloat16()),
                {},
            ),
        ]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """[T, H, D] rotated: ``(x1 cos - x2 sin, x2 cos + x1 sin)`` over the two halves."""
    x1, x2 = x.chunk(2, dim=-1)  # each [T, H, D / 2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


__all__ = ["SUPPORTED_ROPE_TYPES", "RotaryEmbedding", "rope_inv_freq"]
