"""The cpu platform's batch-invariant mode (``model.batch_invariant``): bf16 products whose rows do
not depend on the rest of the batch.

What makes bf16 output depend on the batch here, found by comparing every layer's output for one
request run alone and inside a batch of 32 (SmolLM2-135M, oneDNN-packed weights, 1 and 2 threads):

- oneDNN's bf16 matmul changes how it splits the reduction once a call has enough rows: the
  1536 -> 576 down projection gives rows that differ from the same rows computed alone from about
  130 rows up on a CPU with AMX (a 32-prompt prefill has ~300), and from 4 rows up on an
  AVX512-BF16 CPU without AMX (a Xeon VM, 2026-12-01). So this mode runs the ``linear`` and
  ``logits_processor`` ops in tiles of at most ``row_tile()`` rows: 128 with AMX, where every
  row then equals its one-row result for every projection of the model and the LM head (decode
  batches are below the tile, so only prefills pay, one extra pass over each weight per 128
  tokens); 1 without, where each row is its own call, the one-row result by construction (slow,
  for a mode that exists for exactness).
- decode attention pads every request's context to the longest in the batch, and the bf16
  ``probs @ v`` product rounds differently for another padded length, although the padding
  contributes zeros. ``CPUBatchInvariantAttentionBackend``
  (``kiln.model_executor.layers.attention.backends.cpu_batch_invariant``) pads each request to a
  length that depends on that request alone.

The rest of the step (norms, rotary embedding, activation, prefill attention, sampling) already
computes each row or request on its own. These are measured facts about oneDNN on these CPUs, not
guarantees of its API; ``tests/platforms/test_cpu_batch_invariant.py`` checks them on every run.
"""

from __future__ import annotations

from typing import Any

import torch

from kiln.model_executor.custom_op import register_impl
from kiln.platforms import cpu_flags, cpu_ops

PROVIDER = "onednn_batch_invariant"

AMX_ROW_TILE = 128
"""The most rows one oneDNN call gets in this mode on a CPU with AMX (the measured limit above)."""


def row_tile() -> int:
    """Rows per oneDNN call in this mode: ``AMX_ROW_TILE`` where /proc/cpuinfo lists AMX-BF16,
    else 1 (see the module docstring)."""
    return AMX_ROW_TILE if "amx_bf16" in cpu_flags() else 1


def _tiled(x: torch.Tensor, module: torch.nn.Module, weight: torch.Tensor, bias: Any) -> Any:
    # [num_tokens, input] -> [num_tokens, output], at most row_tile() rows per oneDNN call.
    tile = row_tile()
    if x.shape[0] <= tile:
        return cpu_ops._linear(x, module, weight, bias)
    return torch.cat([cpu_ops._linear(rows, module, weight, bias) for rows in x.split(tile)])


def _linear_supports(op: Any, x: torch.Tensor) -> bool:
    return getattr(op, "batch_invariant", False) and cpu_ops._linear_supports(op, x)


def linear_batch_invariant(op: Any, x: torch.Tensor) -> torch.Tensor:
    """``linear`` op: [num_tokens, input_size] -> [num_tokens, output_size], row by row stable."""
    return _tiled(x, op, op.weight, op.bias)


def _logits_supports(op: Any, lm_head: Any, hidden_states: torch.Tensor) -> bool:
    return getattr(op, "batch_invariant", False) and cpu_ops._logits_supports(
        op, lm_head, hidden_states
    )


def logits_batch_invariant(op: Any, lm_head: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    """``logits_processor`` op: [N, hidden] -> [N, vocab_size] float32, row by row stable."""
    logits = _tiled(hidden_states, lm_head, lm_head.weight, lm_head.bias)
    logits = logits[..., : op.vocab_size].float()
    if op.scale != 1.0:
        logits.mul_(op.scale)
    return logits


def register_batch_invariant_ops() -> None:
    """Register the implementations (idempotent); nothing when oneDNN has no bf16 here.

    They outrank the plain oneDNN ones and accept only layers built with ``batch_invariant``.
    """
    if not cpu_ops.onednn_bf16_available():
        return
    register_impl("linear", PROVIDER, device_type="cpu", priority=20, supports=_linear_supports)(
        linear_batch_invariant
    )
    register_impl(
        "logits_processor", PROVIDER, device_type="cpu", priority=20, supports=_logits_supports
    )(logits_batch_invariant)
