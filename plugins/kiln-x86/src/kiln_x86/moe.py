"""kiln-x86's ``fused_moe`` (Kiln's op: ``kiln.model_executor.layers.fused_moe``): a C++ kernel
(``csrc/x86_moe.cpp``, its own extension ``kiln_x86.moe``) that routes and runs the experts of up
to ``MOE_MAX_TOKENS[dtype]`` tokens in one call, reading only the routed experts' weights.

Why: at decode sizes the reference's per-expert loop (gather, two matmuls, activation, weighted
``index_add``, and a host sync for the expert counts) is a dozen ATen calls per routed expert; the
kernel groups the (token, expert) pairs by expert and runs every routed expert's row blocks in one
parallel loop. Larger batches (prefills) run the reference, whose per-expert matmuls are blocked.

Contract: ``fused_moe(op, hidden_states [T, H], router_logits [T, E])`` returns what the op's
``forward_native`` returns, a rank's local experts included (expert parallelism: the kernel
routes over all E experts and computes only the ``L`` that ``op.w13_weight`` [L, 2I, H] holds,
from expert ``op.expert_offset``): float32 to float32 precision (its sums run in another
order), and in bfloat16 closer to the float64 result than the reference, which rounds each
matmul and the activation to bfloat16 where the kernel keeps float32 to the end. Routing ties
go to the lower expert index. In a graph being captured the kernel is
``torch.ops.kiln_x86_moe.fused_moe`` (with a fake implementation for ``torch.compile``).

``register_x86_moe()`` registers it under provider ``kiln_x86`` for float32 and bfloat16 CPU
tensors of one dtype (the conformance kit compares it with ``forward_native``); where the
extension cannot be built nothing is registered and the reference runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kiln.plugin_api import is_capturing, register_impl
from kiln_x86.kernels import CFLAGS, load_extension
from kiln_x86.ops import PRIORITY, PROVIDER

SOURCE = Path(__file__).parent / "csrc" / "x86_moe.cpp"
MOE_MAX_TOKENS = {torch.float32: 32, torch.bfloat16: 16}
"""Above this many tokens the reference's per-expert matmuls (blocked, parallel) win: the kernel
reads each weight row once for up to 4 of an expert's tokens at a time, but it is no blocked
GEMM. Measured with ``benchmarks/moe_bench.py`` (8 experts, top-2, hidden 2048, intermediate
768; AVX512-BF16, 2 cores): float32 2.1x the loop at 16 tokens, 1.3x at 32, 0.9x at 64;
bfloat16 1.5x at 16, 0.9x at 32."""

_KERNELS: Any = None


def load_moe_kernels() -> Any:
    """The compiled ``csrc/x86_moe.cpp`` (built into the cache on first use), or None."""
    return load_extension("kiln_x86_moe", SOURCE, CFLAGS)


def _supports(op: Any, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> bool:
    w13, w2 = op.w13_weight, op.w2_weight
    return (
        hidden_states.dim() == 2
        and hidden_states.dtype in MOE_MAX_TOKENS
        and hidden_states.shape[0] <= MOE_MAX_TOKENS[hidden_states.dtype]
        and all(t.is_cpu and t.dtype == hidden_states.dtype for t in (w13, w2))
        and router_logits.is_cpu
        and hidden_states.is_contiguous()
        and w13.is_contiguous()
        and w2.is_contiguous()
    )


def fused_moe(op: Any, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
    """``fused_moe`` op: [T, H] hidden states, [T, E] router logits -> [T, H]."""
    args = (
        hidden_states,
        router_logits,
        op.w13_weight,
        op.w2_weight,
        op.top_k,
        op.renormalize,
        op.scoring_func,
        op.expert_offset,
    )
    if is_capturing():
        return torch.ops.kiln_x86_moe.fused_moe(*args)
    return _KERNELS.fused_moe(*args)


def _register_fake() -> None:
    def fused_moe_fake(
        hidden_states, router_logits, w13, w2, top_k, renormalize, scoring_func, expert_offset=0
    ):
        return torch.empty_like(hidden_states)

    try:
        torch.library.register_fake("kiln_x86_moe::fused_moe")(fused_moe_fake)
    except RuntimeError:
        pass  # registered by an earlier call in this process


def register_x86_moe() -> bool:
    """Register the kernel as the ``kiln_x86`` provider of ``fused_moe`` (idempotent). False,
    with nothing registered, when it cannot be built here."""
    global _KERNELS
    _KERNELS = _KERNELS or load_moe_kernels()
    if _KERNELS is None:
        return False
    _register_fake()
    register_impl("fused_moe", PROVIDER, device_type="cpu", priority=PRIORITY, supports=_supports)(
        fused_moe
    )
    return True


__all__ = ["MOE_MAX_TOKENS", "fused_moe", "load_moe_kernels", "register_x86_moe"]
