"""kiln-x86's attention backend: paged attention over the KV cache in place, in C++.

Contract: Kiln's ``AttentionBackend`` (``kiln.model_executor.layers.attention.backend``) with the
reference CPU backend's cache layout, ``[2, num_blocks, block_size, num_kv_heads, head_size]``
(keys, then values), so caches, block tables and slot mappings are the core's. ``forward`` is one
C++ call (``csrc/x86_attention.cpp``) that writes the step's keys and values into the cache at
their slots (as the reference's ``index_copy_`` does), then attends every request of the step,
decodes and prefills in any order, over its context where it lies in the cache: blocks are read
through the block table, never gathered into a copy; a prefill with a cached prefix (a
prefix-cache hit, a later chunk of a long prompt) attends over the cached blocks plus its new
tokens with the causal offset. Grouped-query heads share each K/V read; softmax and accumulation
are float32 for float32 and bfloat16 caches.

The metadata is the core's tensors, made contiguous int32 once per step; a request whose new
tokens are all generated ones (a speculative step's verification) is attended as one-token decodes
(``rows_as_decodes``), so that every generated token's row gets the bits of a plain decode step,
and greedy speculation the tokens and logprobs of no speculation; prompt rows are always tiled
(``prompt_reqs``), one left included, and a tiled row's rounding does not depend on the tile it
falls in, so a prefix-cache hit's or a later chunk's rows get the whole prompt's bits, on any CPU.
A decode's rounding depends on its own context length only, not on the thread count or the step's
other requests. Where the
kernels cannot be built (no compiler) the backend logs it once and runs the reference CPU backend
instead. Float16 models and batch-invariant mode keep the reference backends (the platform names
them): the kernel handles float32 and bfloat16, and its prefill tiles are not held to batch
invariance (only a decode's independence of the step is tested).

The kernel has no logits soft-capping (Gemma 2's ``attn_logit_softcapping``): a layer built with
``logits_soft_cap`` says so once, in a warning at start-up, and runs on the reference CPU
backend's implementation, whose metadata the step's metadata builds on first use
(``X86AttentionMetadata.reference``); the cache layout is the same, so the other layers keep the
kernel.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from kiln.plugin_api import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from kiln_x86.kernels import ATTENTION_CFLAGS, ATTENTION_SOURCE, load_extension

EXTENSION = "kiln_x86_attention"

logger = logging.getLogger(__name__)


def load_attention_kernels() -> ModuleType | None:
    """The compiled attention kernel (built on first use), or None where it cannot be built."""
    return load_extension(EXTENSION, ATTENTION_SOURCE, ATTENTION_CFLAGS)


def _reference_backend() -> type[AttentionBackend]:
    # The reference platform's backend, which X86Platform's parent names; only without a compiler.
    from kiln.plugin_api import CPUAttentionBackend

    return CPUAttentionBackend


@dataclass
class X86AttentionMetadata:
    """The step's batch as the kernel reads it (CPU tensors, built once per step)."""

    num_actual_tokens: int
    slot_mapping: torch.Tensor
    """[num_actual_tokens] int64: each new token's cache slot."""
    query_start_loc: torch.Tensor
    """[num_reqs + 1] int32."""
    seq_lens: torch.Tensor
    """[num_reqs] int32: context after the step, the new tokens included."""
    block_table: torch.Tensor
    """[num_reqs, max_num_blocks_per_req] int32, contiguous."""
    prompt_reqs: torch.Tensor
    """[num_reqs] int32, 1 where a request's new rows are prompt rows (the kernel tiles them even
    when there is one), or empty where the core did not say (one new row is then a decode)."""
    common: CommonAttentionMetadata | None = None
    """The core's metadata of the step, for ``reference``."""
    reference_builder: AttentionMetadataBuilder[Any] | None = None
    _reference: Any = field(default=None, repr=False)

    def reference(self) -> Any:
        """The reference CPU backend's metadata of this step (for soft-capped layers), built on
        the first call and shared by every layer of the step."""
        if self._reference is None:
            assert self.common is not None and self.reference_builder is not None
            self._reference = self.reference_builder.build(self.common)
        return self._reference


class X86AttentionMetadataBuilder(AttentionMetadataBuilder[Any]):
    """The core's metadata as contiguous int32 tensors (or the reference's, without kernels)."""

    def __init__(self, block_size: int, device: torch.device | str = "cpu") -> None:
        super().__init__(block_size, device)
        self.reference: AttentionMetadataBuilder[Any] | None = None
        # For layers the kernel cannot compute (soft-capped ones), or for all without kernels.
        self.reference_builder = _reference_backend().get_metadata_builder_cls()(block_size, device)
        if load_attention_kernels() is None:
            self.reference = self.reference_builder

    def build(self, common: CommonAttentionMetadata) -> Any:
        if self.reference is not None:
            return self.reference.build(common)
        n = common.num_reqs
        query_start_loc = common.query_start_loc[: n + 1].to(torch.int32)
        seq_lens = common.seq_lens[:n].to(torch.int32)
        block_table = common.block_table[:n].to(torch.int32)
        prompt_reqs = torch.empty(0, dtype=torch.int32)
        if common.num_prompt_tokens is not None:
            is_generated = common.num_computed_tokens[:n] >= common.num_prompt_tokens[:n]
            query_start_loc, seq_lens, block_table, is_generated = rows_as_decodes(
                query_start_loc, seq_lens, block_table, is_generated
            )
            prompt_reqs = (~is_generated).to(torch.int32)
        return X86AttentionMetadata(
            num_actual_tokens=common.num_actual_tokens,
            slot_mapping=common.slot_mapping[: common.num_actual_tokens].to(torch.int64),
            query_start_loc=query_start_loc.contiguous(),
            seq_lens=seq_lens.contiguous(),
            block_table=block_table.contiguous(),
            prompt_reqs=prompt_reqs.contiguous(),
            common=common,
            reference_builder=self.reference_builder,
        )


def rows_as_decodes(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    is_generated: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's requests with each request of several new tokens that are all generated ones
    (``is_generated`` [num_reqs] bool: a speculative step's verification, 1 + k rows) split into
    one-token requests: same block table, context ending at each row's own position.

    The kernel then computes every such row exactly as the decode step at that position would
    (attention is the one layer whose rounding depends on a request's row count: several rows
    take the tile path, one the decode kernel), so greedy speculation gives the tokens and
    logprobs of no speculation bit for bit. Prompt rows are left as they are: they are computed
    as the prompt's prefill computes them, so a prefix-cache hit's few remaining prompt rows get
    the bits of the cold prefill's (computing them as decodes flipped a near-tie first token of
    a repeated chat question, "Paris" -> "L'Étoile"). Tokens keep their order, so queries,
    outputs and slots are unchanged. Int32 CPU tensors in and out, and ``is_generated`` per
    request of the result.
    """
    q_lens = query_start_loc[1:] - query_start_loc[:-1]  # [num_reqs]
    split = (q_lens > 1) & is_generated
    if not bool(split.any()):
        return query_start_loc, seq_lens, block_table, is_generated
    repeats = torch.where(split, q_lens, 1)
    owner = torch.repeat_interleave(torch.arange(len(q_lens)), repeats)  # [new num_reqs]
    first = torch.cumsum(repeats, 0) - repeats  # each request's first new row
    row = torch.arange(len(owner), dtype=torch.int32) - first[owner]  # row within its request
    is_split = split[owner]
    new_q_lens = torch.where(is_split, 1, q_lens[owner])
    new_seq_lens = torch.where(is_split, seq_lens[owner] - q_lens[owner] + row + 1, seq_lens[owner])
    new_start_loc = torch.zeros(len(owner) + 1, dtype=torch.int32)
    torch.cumsum(new_q_lens, 0, out=new_start_loc[1:])
    return new_start_loc, new_seq_lens.to(torch.int32), block_table[owner], is_generated[owner]


class X86AttentionImpl(AttentionImpl[Any]):
    """One layer's paged attention through the C++ kernel; see the module docstring."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, sliding_window, logits_soft_cap)
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        self.kernels = load_attention_kernels()
        self.reference: AttentionImpl[Any] | None = None
        # A soft-capped layer: the reference on the step's reference metadata (see the module).
        self.soft_capped = logits_soft_cap is not None and self.kernels is not None
        if self.kernels is None or self.soft_capped:
            reference_cls = _reference_backend().get_impl_cls()
            shape = (num_heads, head_size, scale, num_kv_heads)
            self.reference = reference_cls(*shape, sliding_window, logits_soft_cap)
        if self.soft_capped:
            _warn_soft_cap_once()

    def forward(
        self,
        layer: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
    ) -> torch.Tensor:
        if self.soft_capped:
            assert self.reference is not None
            md_ref = attn_metadata.reference()
            return self.reference.forward(layer, query, key, value, kv_cache, md_ref)
        if self.reference is not None:
            return self.reference.forward(layer, query, key, value, kv_cache, attn_metadata)
        md: X86AttentionMetadata = attn_metadata
        num_tokens, n = query.shape[0], md.num_actual_tokens
        key_cache, value_cache = kv_cache[0], kv_cache[1]  # each [num_blocks, block_size, Hkv, D]
        out = query.new_empty(num_tokens, self.num_heads, self.head_size, dtype=key_cache.dtype)
        if num_tokens > n:
            out[n:].zero_()
        assert self.kernels is not None  # no reference: the kernels loaded
        # One call writes the step's keys and values at their slots, then attends.
        self.kernels.paged_attention_update(
            out,
            query.to(key_cache.dtype),
            key.to(key_cache.dtype),
            value.to(key_cache.dtype),
            key_cache,
            value_cache,
            md.slot_mapping,
            md.block_table,
            md.query_start_loc,
            md.seq_lens,
            self.scale,
            self.sliding_window or 0,
            md.prompt_reqs,
        )
        return out.view(num_tokens, self.num_heads * self.head_size).to(query.dtype)


@functools.cache
def _warn_soft_cap_once() -> None:
    logger.warning(
        "x86: the attention kernel has no logits_soft_cap (Gemma 2's attn_logit_softcapping); "
        "soft-capped layers run on the reference CPU attention backend"
    )


class X86AttentionBackend(AttentionBackend):
    """kiln-x86's paged attention (``X86Platform.get_attn_backend_cls``)."""

    @staticmethod
    def get_name() -> str:
        return "X86_PAGED"

    @staticmethod
    def get_impl_cls() -> type[X86AttentionImpl]:
        return X86AttentionImpl

    @staticmethod
    def get_metadata_builder_cls() -> type[X86AttentionMetadataBuilder]:
        return X86AttentionMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)


__all__ = [
    "X86AttentionBackend",
    "X86AttentionImpl",
    "X86AttentionMetadata",
    "X86AttentionMetadataBuilder",
    "load_attention_kernels",
]
