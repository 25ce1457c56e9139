"""The ``lora_apply`` op: add each token's adapter to a linear layer's output, many adapters in one
batch (punica's batched gather-matmul: a shrink to the rank, then an expand per output slice).

Contract: ``LoRAApply()(y, x, lora_a, lora_b, token_lora_indices, output_slices)`` with

- ``y`` [T, out]: the base layer's output, updated in place and returned;
- ``x`` [T, in]: the layer's input;
- ``lora_a`` [n, S, R, in]: adapter slot ``s``'s A of output slice ``i`` (a fused layer has one
  slice per projection: q, k, v, or gate, up), zero past the adapter's rank;
- ``lora_b`` [out, S, R]: slot ``s``'s B (scaling applied) for every output feature, zero past the
  rank and for slices the adapter does not touch;
- ``token_lora_indices`` [T] int64: each token's slot, ``-1`` for a token of the base model, which
  gets nothing added;
- ``output_slices``: the ``n`` slices' widths, which sum to ``out``.

``y[t, slice i] += lora_b[slice i, s] @ (lora_a[i, s] @ x[t])`` with ``s = token_lora_indices[t]``.
The native version has no host sync and no loop over tokens or adapters: it shrinks against every
slot at once and zeroes the slots a token does not use (``S * R`` is small), then one matmul per
slice expands. A platform registers a faster kernel for op ``lora_apply``
(``kiln.model_executor.custom_op.register_impl``).

This module knows nothing about adapters, requests or models.
"""

from __future__ import annotations

import torch

from kiln.model_executor.custom_op import CustomOp, register_op


@register_op("lora_apply")
class LoRAApply(CustomOp):
    """Per-token LoRA deltas added to a linear layer's output (see the module docstring)."""

    def forward_native(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        token_lora_indices: torch.Tensor,
        output_slices: tuple[int, ...],
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        num_slices, num_slots, rank, in_features = lora_a.shape
        shrink = x @ lora_a.view(-1, in_features).T  # [T, n * S * R]
        slots = torch.arange(num_slots, device=x.device)
        one_hot = (token_lora_indices[:, None] == slots).to(x.dtype)  # [T, S]; -1 matches none
        shrink = shrink.view(num_tokens, num_slices, num_slots, rank) * one_hot[:, None, :, None]
        shrink = shrink.view(num_tokens, num_slices, num_slots * rank)
        offset = 0
        for i, size in enumerate(output_slices):
            b = lora_b[offset : offset + size].view(size, num_slots * rank)  # [size, S * R]
            y[:, offset : offset + size] += shrink[:, i] @ b.T
            offset += size
        return y

    @classmethod
    def make_examples(cls, generator: torch.Generator) -> list[tuple[CustomOp, tuple, dict]]:
        examples: list[tuple[CustomOp, tuple, dict]] = []
        cases = (((24, 8, 8), 7, torch.float32), ((40,), 3, torch.bfloat16))
        for slices, num_tokens, dtype in cases:
            out, num_slots, rank, in_features = sum(slices), 3, 4, 16
            y = torch.randn(num_tokens, out, generator=generator).to(dtype)
            x = torch.randn(num_tokens, in_features, generator=generator).to(dtype)
            lora_a = torch.randn(len(slices), num_slots, rank, in_features, generator=generator)
            lora_b = torch.randn(out, num_slots, rank, generator=generator)
            indices = torch.randint(-1, num_slots, (num_tokens,), generator=generator)
            args = (y, x, lora_a.to(dtype), lora_b.to(dtype), indices, slices)
            examples.append((cls(), args, {}))
        return examples


__all__ = ["LoRAApply"]
