"""The ``lora_apply`` op: add each token's adapter to a linear layer's output, many adapters in one
batch (punica's batched gather-matmul: a shrink to the rank, then an expand).

Contract: ``LoRAApply()(y, x, lora_a, lora_b, mapping, output_slices=())`` with

- ``y`` [T, out]: the base layer's output, updated in place and returned;
- ``x`` [T, in]: the layer's input;
- ``lora_a`` [S, K, in]: adapter slot ``s``'s A rows; a fused layer stacks its ``n`` output
  slices' A (q, k, v, or gate, up) in blocks of ``R`` rows, so ``K = n * R``; zero past the
  adapter's rank;
- ``lora_b`` [S, K, out]: slot ``s``'s B transposed (scaling applied), block-diagonal: the ``R``
  rows of slice ``i`` hold its B only in slice ``i``'s output columns and are zero elsewhere, so
  a slice's A never reaches another slice's outputs;
- ``mapping``: the step's ``LoRAMapping`` (each token's slot, built once per step and shared by
  every layer);
- ``output_slices``: the ``n`` slices' widths (summing to ``out``; ``()``: not given), so that a
  kernel may skip ``lora_b``'s zero blocks; the native version does not need them.

``y[t] += lora_b[s].T @ (lora_a[s] @ x[t])`` with ``s = mapping.token_lora_indices[t]``; a token
of the base model (slot ``-1``) gets nothing added. The native version runs three ATen calls a
layer, with no host sync and no loop over tokens, adapters or slices: one shrink against the
slots the step uses, a multiply by the step's one-hot slot mask (zeroing the slots a token does
not use), and one expand added into ``y``. A platform registers a faster kernel for op
``lora_apply`` (``kiln.model_executor.custom_op.register_impl``).

This module knows nothing about adapters, requests or models.
"""

from __future__ import annotations

import numpy as np
import torch

from kiln.model_executor.custom_op import CustomOp, register_op


class LoRAMapping:
    """Which slot each token of a step uses, and the masks derived from it (built on first use,
    once per step, then shared by every layer).

    Args:
        token_lora_indices: [T] int64 on the host, each token's slot, ``-1`` for the base model;
            at least one token uses a slot.
        device: where the layers run.
    """

    def __init__(self, token_lora_indices: np.ndarray, device: torch.device) -> None:
        used = token_lora_indices[token_lora_indices >= 0]
        assert used.size, "a LoRAMapping needs a token with an adapter"
        self.first_slot = int(used.min())
        """The lowest slot a token uses: the op reads slots ``first_slot .. end_slot - 1``."""
        self.end_slot = int(used.max()) + 1
        self.token_lora_indices = torch.from_numpy(token_lora_indices).to(device)
        """[T] int64: each token's slot, -1 for the base model."""
        self.all_one_slot = used.size == token_lora_indices.size and self.first_slot + 1 == (
            self.end_slot
        )
        """Every token uses the same slot: no mask is needed."""
        self._local = self.token_lora_indices - self.first_slot
        self._masks: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def slot_mask(self, width: int, dtype: torch.dtype) -> torch.Tensor:
        """[T, (end_slot - first_slot) * width] of ``dtype``: ones in the ``width`` columns of the
        token's slot, zeros elsewhere (a base-model token's row is all zeros)."""
        mask = self._masks.get((width, dtype))
        if mask is None:
            slots = torch.arange(self.end_slot - self.first_slot, device=self._local.device)
            one_hot = (self._local[:, None] == slots).to(dtype)  # [T, slots]; -1 matches none
            mask = one_hot.repeat_interleave(width, dim=1)
            self._masks[(width, dtype)] = mask
        return mask


@register_op("lora_apply")
class LoRAApply(CustomOp):
    """Per-token LoRA deltas added to a linear layer's output (see the module docstring)."""

    def forward_native(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        mapping: LoRAMapping,
        output_slices: tuple[int, ...] = (),
    ) -> torch.Tensor:
        _, width, in_features = lora_a.shape
        slots = slice(mapping.first_slot, mapping.end_slot)
        # Contiguous slots: both views are free.
        a = lora_a[slots].view(-1, in_features)  # [used * K, in]
        b = lora_b[slots].view(-1, lora_b.shape[-1])  # [used * K, out]
        shrink = x @ a.T  # [T, used * K]
        if not mapping.all_one_slot:
            shrink.mul_(mapping.slot_mask(width, shrink.dtype))
        return y.addmm_(shrink, b)

    @classmethod
    def make_examples(cls, generator: torch.Generator) -> list[tuple[CustomOp, tuple, dict]]:
        examples: list[tuple[CustomOp, tuple, dict]] = []
        cases = (
            ((24, 8, 8), [0, -1, 2, 1, 2, -1, 0], torch.float32),
            ((40,), [2, 1, -1], torch.bfloat16),
            ((12, 12), [1, 1, 1, 1], torch.float32),
        )
        for slices, indices, dtype in cases:
            num_slots, rank, in_features = 3, 4, 16
            lora_a, lora_b = random_slots(slices, num_slots, rank, in_features, generator)
            # An adapter's scale: a delta small beside the base output, as trained ones are.
            lora_a, lora_b = lora_a / in_features**0.5, 0.1 * lora_b
            y = torch.randn(len(indices), sum(slices), generator=generator).to(dtype)
            x = torch.randn(len(indices), in_features, generator=generator).to(dtype)
            mapping = LoRAMapping(np.array(indices, dtype=np.int64), x.device)
            args = (y, x, lora_a.to(dtype), lora_b.to(dtype), mapping, slices)
            examples.append((cls(), args, {}))
        return examples


def random_slots(
    slices: tuple[int, ...],
    num_slots: int,
    rank: int,
    in_features: int,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``lora_a`` [S, n * R, in] and block-diagonal ``lora_b`` [S, n * R, out] in the
    op's layout (float32), for tests and examples."""
    num_slices, out = len(slices), sum(slices)
    lora_a = torch.randn(num_slots, num_slices * rank, in_features, generator=generator)
    lora_b = torch.zeros(num_slots, num_slices * rank, out)
    offset = 0
    for i, size in enumerate(slices):
        block = torch.randn(num_slots, rank, size, generator=generator)
        lora_b[:, i * rank : (i + 1) * rank, offset : offset + size] = block
        offset += size
    return lora_a, lora_b


__all__ = ["LoRAApply", "LoRAMapping", "random_slots"]
