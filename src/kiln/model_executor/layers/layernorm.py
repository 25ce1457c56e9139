"""RMSNorm with an optional fused residual add.

Contract: ``RMSNorm(hidden_size, eps)(x)`` normalizes the last dimension of ``x`` the way Hugging
Face's ``LlamaRMSNorm`` does (statistics in float32, result cast back to ``x``'s dtype, then
scaled by ``weight``). ``norm(x, residual)`` first adds the residual stream, as vLLM's decoder
layers do, and returns ``(normed, x + residual)``: one call per sub-layer instead of an add and a
norm, and a fusion point for providers (the custom op ``"rms_norm"``).

``GemmaRMSNorm`` is Gemma's variant: the checkpoint stores ``w`` and the scale is ``1 + w``, and
the whole of it (statistics, scale) is computed in float32 and rounded once (custom op
``"gemma_rms_norm"``, so providers of ``"rms_norm"`` do not take it).

``ShardedRMSNorm`` normalizes a dimension that tensor parallelism splits over ranks (OLMo 2's q/k
norms span every head of the projection): each rank holds its columns of the weight and the mean
square is summed over ranks.

This module knows nothing about models.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.distributed.parallel_state import TensorParallelGroup
from kiln.model_executor.custom_op import CustomOp, register_op
from kiln.model_executor.layers.linear import default_weight_loader, set_weight_attrs


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


@register_op("gemma_rms_norm")
class GemmaRMSNorm(RMSNorm):
    """``x / rms(x) * (1 + weight)`` in float32, rounded to ``x``'s dtype once (Hugging Face's
    ``Gemma2RMSNorm`` / ``Gemma3RMSNorm``); with a residual, ``(normed, x + residual)`` as
    ``RMSNorm``. ``weight`` starts at zeros (a scale of 1), as the checkpoints' init."""

    def __init__(
        self, hidden_size: int, eps: float = 1e-6, params_dtype: torch.dtype | None = None
    ) -> None:
        super().__init__(hidden_size, eps, params_dtype)
        self.weight.data.zero_()

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``x`` [..., hidden_size] -> normed, or ``(normed, x + residual)`` with a residual."""
        if residual is not None:
            x = x + residual  # in the model dtype, as Hugging Face adds its residuals
            residual = x
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        out = (normed * (1.0 + self.weight.float())).to(x.dtype)
        return out if residual is None else (out, residual)


class ShardedRMSNorm(RMSNorm):
    """RMSNorm over a last dimension of which this rank holds a slice.

    Args:
        hidden_size: this rank's columns.
        eps: added to the mean square before the reciprocal square root.
        params_dtype: dtype of ``weight``.
        shard_start: where this rank's columns begin in the checkpoint's weight.
        num_summed: columns over all ranks, counted once per rank that holds them (with heads
            replicated over ranks, each copy counts, as it does in the summed squares).
        tp_group: the ranks the dimension is split over.

    With one rank this is ``RMSNorm``. ``weight``'s loader takes the whole checkpoint tensor and
    keeps this rank's slice.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float,
        params_dtype: torch.dtype | None,
        *,
        shard_start: int,
        num_summed: int,
        tp_group: TensorParallelGroup,
    ) -> None:
        super().__init__(hidden_size, eps, params_dtype)
        self.shard_start = shard_start
        self.num_summed = num_summed
        self.tp_group = tp_group
        set_weight_attrs(self.weight, {"weight_loader": self.weight_loader})

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        """Copy this rank's columns of the whole weight."""
        local = loaded_weight.narrow(0, self.shard_start, self.hidden_size)
        default_weight_loader(param, local, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [..., hidden_size] (this rank's columns) -> normed."""
        if self.tp_group.world_size == 1:
            return super().forward(x)
        xf = x.float()
        # [..., 1]: the mean square over every rank's columns.
        variance = self.tp_group.all_reduce(xf.pow(2).sum(-1, keepdim=True)) / self.num_summed
        return self.weight * (xf * torch.rsqrt(variance + self.variance_epsilon)).to(x.dtype)


__all__ = ["GemmaRMSNorm", "RMSNorm", "ShardedRMSNorm"]
