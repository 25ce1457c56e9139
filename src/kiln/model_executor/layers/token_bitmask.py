"""The structured-output mask: logits of tokens a request's grammar forbids set to -inf.

Contract: ``ApplyTokenBitmask()(logits [B, V], bitmask [K, W] int32, rows [K] int64)`` returns
the logits (float, new tensor or ``logits`` itself) where, for each ``k``, row ``rows[k]`` keeps
token ``t`` only when bit ``t % 32`` of ``bitmask[k, t // 32]`` is set; other rows are unchanged.
Tokens past ``32 * W`` are forbidden. The bitmask is what the grammar engines (xgrammar,
llguidance) fill. Pure tensor ops, no host sync; a platform supplies a faster kernel by
registering an implementation of op ``apply_token_bitmask``.

This module knows nothing about grammars or requests.
"""

from __future__ import annotations

import torch

from kiln.model_executor.custom_op import CustomOp, register_op


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[K, W] int32 -> [K, vocab_size] bool, True where the token is allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # [32]
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [K, W, 32]
    allowed = bits.flatten(1).bool()  # [K, 32 * W]
    width = allowed.shape[1]
    if width >= vocab_size:
        return allowed[:, :vocab_size]
    pad = torch.zeros(allowed.shape[0], vocab_size - width, dtype=torch.bool, device=bitmask.device)
    return torch.cat([allowed, pad], dim=1)


@register_op("apply_token_bitmask")
class ApplyTokenBitmask(CustomOp):
    """Mask ``logits`` rows by grammar bitmasks (see the module docstring)."""

    def forward_native(
        self, logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor
    ) -> torch.Tensor:
        allowed = unpack_bitmask(bitmask, logits.shape[1])  # [K, V]
        masked = logits[rows].masked_fill(~allowed, float("-inf"))  # [K, V]
        return logits.index_put((rows,), masked)

    @classmethod
    def make_examples(cls, generator: torch.Generator) -> list[tuple[CustomOp, tuple, dict]]:
        logits = torch.randn(5, 100, generator=generator)
        bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 4), generator=generator, dtype=torch.int64)
        bitmask = bitmask.to(torch.int32)  # [3, 4]: 128 bits for 100 tokens
        rows = torch.tensor([0, 2, 4])
        return [
            (cls(), (logits, bitmask, rows), {}),
            (cls(), (logits[:1], bitmask[:1, :3], rows[:1]), {}),  # 96 bits: tokens 96.. forbidden
        ]


__all__ = ["ApplyTokenBitmask", "unpack_bitmask"]
