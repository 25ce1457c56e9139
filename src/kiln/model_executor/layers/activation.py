"""Gated activations: ``SiluAndMul`` for the SwiGLU MLPs of Llama and Qwen, ``GeluAndMul`` for
Gemma's GeGLU.

Contract: the input is the output of a fused gate/up projection, ``[..., 2 * intermediate]`` with
the gate in the first half; the result is ``act(gate) * up``, ``[..., intermediate]``. This
module knows nothing about models.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.model_executor.custom_op import CustomOp, register_op


@register_op("silu_and_mul")
class SiluAndMul(CustomOp):
    """``silu(x[..., :d]) * x[..., d:]`` with ``d = x.shape[-1] // 2``."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        # [..., 2 * d] -> [..., d]; silu allocates once, the in-place mul reuses its buffer.
        return F.silu(x[..., :d]).mul_(x[..., d:])

    @classmethod
    def make_examples(cls, generator: torch.Generator) -> list[tuple[CustomOp, tuple, dict]]:
        x = torch.randn(7, 2 * 48, generator=generator)
        return [(cls(), (x,), {}), (cls(), (x.bfloat16(),), {}), (cls(), (x[:1],), {})]


GELU_APPROXIMATIONS = ("none", "tanh")


@register_op("gelu_and_mul")
class GeluAndMul(CustomOp):
    """``gelu(x[..., :d]) * x[..., d:]`` with ``d = x.shape[-1] // 2``.

    Args:
        approximate: ``"tanh"`` (Hugging Face's ``gelu_pytorch_tanh``) or ``"none"`` (the exact
            erf GELU, ``gelu``).

    Raises:
        ValueError: another ``approximate``.
    """

    def __init__(self, approximate: str = "tanh") -> None:
        super().__init__()
        if approximate not in GELU_APPROXIMATIONS:
            raise ValueError(
                f"approximate={approximate!r} is not supported; allowed: {GELU_APPROXIMATIONS}"
            )
        self.approximate = approximate

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate=self.approximate).mul_(x[..., d:])

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"

    @classmethod
    def make_examples(cls, generator: torch.Generator) -> list[tuple[CustomOp, tuple, dict]]:
        x = torch.randn(7, 2 * 48, generator=generator)
        return [(cls(), (x,), {}), (cls("none"), (x.bfloat16(),), {}), (cls(), (x[:1],), {})]


__all__ = ["GeluAndMul", "SiluAndMul"]
