"""The dense attention reference: plain softmax attention over contiguous keys and values.

No paging, no fused kernels, computed in float32: this is what every backend must match in a
parity test. ``ref_attention`` handles one request; ``ref_batch_attention`` loops over a batch
whose keys and values are held per request in contiguous tensors.

The causal convention is the one every backend follows: a request whose context has ``seq_len``
tokens, of which the last ``query_len`` are new, places query ``i`` at position
``seq_len - query_len + i``; it sees keys at positions ``<=`` its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def ref_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal attention of one request's new tokens over its whole context.

    Args:
        query: [query_len, num_heads, head_size], the last ``query_len`` positions of the context.
        key: [seq_len, num_kv_heads, head_size], the whole context (cached prefix + new tokens).
        value: [seq_len, num_kv_heads, head_size].
        scale: multiplier of ``q @ k^T``.
        sliding_window: if set, query at position p sees keys in ``(p - sliding_window, p]``.
        logits_soft_cap: if set, each scaled score ``s`` is ``cap * tanh(s / cap)``.

    Returns:
        [query_len, num_heads, head_size] in ``query``'s dtype.
    """
    query_len, num_heads, _ = query.shape
    seq_len, num_kv_heads, _ = key.shape
    assert query_len <= seq_len and num_heads % num_kv_heads == 0
    group = num_heads // num_kv_heads
    q = query.float()
    k = key.float().repeat_interleave(group, dim=1)  # [seq_len, num_heads, head_size]
    v = value.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [num_heads, query_len, seq_len]
    if logits_soft_cap is not None:
        scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
    q_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
    k_pos = torch.arange(seq_len)[None, :]
    visible = k_pos <= q_pos  # [query_len, seq_len]
    if sliding_window is not None:
        visible &= k_pos > q_pos - sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hqk,khd->qhd", probs, v)  # [query_len, num_heads, head_size]
    return out.to(query.dtype)


def ref_batch_attention(
    query: torch.Tensor,
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    query_lens: Sequence[int],
    scale: float,
) -> torch.Tensor:
    """``ref_attention`` for each request of a batch.

    Args:
        query: [num_tokens, num_heads, head_size], requests' new tokens back to back.
        keys: per request, [seq_len_i, num_kv_heads, head_size] (its whole context).
        values: per request, like ``keys``.
        query_lens: new tokens per request; they sum to ``num_tokens``.

    Returns:
        [num_tokens, num_heads, head_size].
    """
    outs = []
    start = 0
    for k, v, query_len in zip(keys, values, query_lens, strict=True):
        outs.append(ref_attention(query[start : start + query_len], k, v, scale))
        start += query_len
    return torch.cat(outs) if outs else query.new_empty(query.shape)
