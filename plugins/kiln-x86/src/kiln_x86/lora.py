"""kiln-x86's ``lora_apply`` (Kiln's op: ``kiln.model_executor.layers.lora``): a C++ kernel
(``csrc/x86_lora.cpp``, its own extension ``kiln_x86.lora``) for batches of up to
``LORA_MAX_TOKENS`` tokens, run on the calling thread.

Why: at decode sizes the op is a few hundred thousand multiply-adds a layer, and the reference's
three ATen calls (shrink, mask, expand) each wake and join torch's OpenMP team; on a shared,
loaded machine those joins cost more than the work (docs/x86/results.md, "LoRA kernel"). Larger
batches (prefills) run the reference, whose matmuls are blocked and parallel.

``register_x86_lora()`` registers it under provider ``kiln_x86`` for float32 and bfloat16 CPU
tensors of one dtype (the conformance kit compares it with ``forward_native``); where the
extension cannot be built nothing is registered and the reference runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kiln.plugin_api import register_impl
from kiln_x86.kernels import CFLAGS, load_extension

SOURCE = Path(__file__).parent / "csrc" / "x86_lora.cpp"
PROVIDER = "kiln_x86"
PRIORITY = 20
LORA_MAX_TOKENS = 64
"""Above this many tokens the reference's parallel matmuls win (single-threaded, the kernel's
matrix-vector products re-read each adapter's weights per token)."""

_DTYPES = (torch.float32, torch.bfloat16)
_KERNELS: Any = None


def load_lora_kernels() -> Any:
    """The compiled ``csrc/x86_lora.cpp`` (built into the cache on first use), or None."""
    return load_extension("kiln_x86_lora", SOURCE, CFLAGS)


def _supports(op: Any, y: torch.Tensor, x: torch.Tensor, *weights_and_mapping: Any) -> bool:
    lora_a, lora_b = weights_and_mapping[:2]
    tensors = (y, x, lora_a, lora_b)
    return (
        x.shape[0] <= LORA_MAX_TOKENS
        and y.dtype in _DTYPES
        and all(t.device.type == "cpu" and t.dtype == y.dtype for t in tensors)
        and all(t.is_contiguous() for t in tensors)
    )


def lora_apply(
    op: Any,
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    mapping: Any,
    output_slices: tuple[int, ...] = (),
) -> torch.Tensor:
    """``lora_apply`` op: ``y`` [T, out] plus each token's adapter, in place (``mapping``: the
    op's ``LoRAMapping``: ``token_lora_indices``, ``first_slot``, ``end_slot``; with
    ``output_slices`` the expand skips ``lora_b``'s zero blocks)."""
    return _KERNELS.lora_apply(
        y,
        x,
        lora_a,
        lora_b,
        mapping.token_lora_indices,
        mapping.first_slot,
        mapping.end_slot,
        list(output_slices),
    )


def register_x86_lora() -> bool:
    """Register the kernel as the ``kiln_x86`` provider of ``lora_apply`` (idempotent). False,
    with nothing registered, when it cannot be built here."""
    global _KERNELS
    kernels = load_lora_kernels()
    if kernels is None:
        return False
    _KERNELS = kernels
    register_impl("lora_apply", PROVIDER, device_type="cpu", priority=PRIORITY, supports=_supports)(
        lora_apply
    )
    return True


__all__ = ["LORA_MAX_TOKENS", "lora_apply", "register_x86_lora"]
