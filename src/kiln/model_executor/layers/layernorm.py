"""RMSNorm with an optional fused residual add.

Contract: ``RMSNorm(hidden_size, eps)(x)`` normalizes the last dimension of ``x`` the way Hugging
Face's ``LlamaRMSNorm`` does (statistics in float32, result cast back to ``x``'s dtype, then
scaled by ``weight``). ``norm(x, residual)`` first adds the residual stream, as vLLM's decoder
layers do, and returns ``(normed, x + residual)``: one call per sub-layer instead of an add and a
norm, and a fusion point for providers (the custom op ``"rms_norm"``).

This module knows nothing about models.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.model_executor.custom_op import CustomOp, register_op


@register_op("rms_norm")
class RMSNorm(CustomOp):
    """Root-mean-square norm over the last dimension.

    Args:
        hidden_size: size of the normalized (last) dimension.
        eps: added to the mean square before the reciprocal square root.
        params_dtype: dtype of ``weight`` (the model's compute dtype).
    """

    def __init__(
        self, hidden_size: int, eps: float = 1e-6, params_dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        self.weight = nn.Parameter(
            torch.ones(hidden_size, dtype=params_dtype or torch.get_default_dtype()),
            requires_grad=False,
        )

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``x`` [..., hidden_size] -> normed, or ``(normed, x + residual)`` with a residual."""
        if residual is not None:
            # In the model dtype, as Hugging Face adds its residuals.
            x = x + residual
            residual = x
        if x.dtype == torch.float32:
            # Same arithmetic as the formula below, in one fused CPU/GPU kernel.
            out = F.rms_norm(x, (self.hidden_size,), self.weight, self.variance_epsilon)
        else:
            # Reduced precision: normalize in float32, round once, then scale in the model
            # dtype; this is Hugging Face's order of rounding, which F.rms_norm does not follow.
            xf = x.float()
            variance = xf.pow(2).mean(-1, keepdim=True)
            out = self.weight * (xf * torch.rsqrt(variance + self.variance_epsilon)).to(x.dtype)
        return out if residual is None else (out, residual)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.variance_epsilon}"

    @classmethod
    def make_examples(cls, generator: torch.Generator) -> list[tuple[CustomOp, tuple, dict]]:
        examples: list[tuple[CustomOp, tuple, dict]] = []
        for dtype in (torch.float32, torch.bfloat16):
            norm = cls(96, 1e-5, dtype)
            norm.weight.data.copy_(1 + 0.1 * torch.randn(96, generator=generator))
            x = torch.randn(5, 96, generator=generator).to(dtype)
            residual = torch.randn(5, 96, generator=generator).to(dtype)
            examples += [(norm, (x,), {}), (norm, (x, residual), {})]
        # Per-head norm (Qwen3's q/k norm): [T, H, D].
        norm = cls(32, 1e-6)
        examples.append((norm, (torch.randn(3, 4, 32, generator=generator),), {}))
        return examples


__all__ = ["RMSNorm"]
