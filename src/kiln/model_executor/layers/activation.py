"""Gated activations: ``SiluAndMul`` for the SwiGLU MLPs of Llama and Qwen.

Contract: the input is the output of a fused gate/up projection, ``[..., 2 * intermediate]`` with
the gate in the first half; the result is ``silu(gate) * up``, ``[..., intermediate]``. This
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


__all__ = ["SiluAndMul"]
