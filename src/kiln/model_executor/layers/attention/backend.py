"""The attention backend interface: what a platform's attention implementation must provide.

A backend is a class of static methods, named by the platform in the config
(``attention_backend``, a dotted path) and checked against this interface when it is resolved
(``validate_attention_backend``). It supplies three things:

- ``get_kv_cache_shape``: the shape of one layer's KV cache tensor, which the model runner allocates
  (with ``torch.zeros``: slots not yet written must hold finite values, since backends may read
  them under a mask).
- an ``AttentionMetadataBuilder``: turns the step's ``CommonAttentionMetadata`` (built once per step
  by the model runner) into the backend's own metadata, once per step, shared by every layer. Index
  work (gathers, masks, the decode/prefill split) belongs here, not in ``forward``.
- an ``AttentionImpl``: one per layer; ``forward`` writes the step's new keys and values into the
  layer's KV cache at ``slot_mapping``, then attends causally over each request's whole context
  (the cached prefix plus the new tokens).

Vocabulary: a request owns a list of block ids (its block table). Token position ``p`` of a request
lives in block ``block_table[p // block_size]`` at offset ``p % block_size``; its slot is
``block_id * block_size + offset``. Requests in a batch are in the model runner's order; a request's
new tokens are contiguous in the token dimension (``query_start_loc``).

This module knows nothing about devices, platforms or models.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

M = TypeVar("M")


@dataclass
class CommonAttentionMetadata:
    """What every backend needs to know about one step's batch; built by the model runner.

    All tensors are on the CPU. ``B`` is ``num_reqs``.
    """

    query_start_loc: torch.Tensor
    """[B + 1] int32: cumulative new-token counts; request i's new tokens are
    ``query_start_loc[i]:query_start_loc[i + 1]`` in the token dimension."""
    seq_lens: torch.Tensor
    """[B] int32: tokens in each request's context after this step (computed + new)."""
    num_computed_tokens: torch.Tensor
    """[B] int32: tokens already in the KV cache before this step (``seq_lens - query_lens``)."""
    block_table: torch.Tensor
    """[B, max_num_blocks_per_req] int32: block ids; entries past a request's last block are
    padding (any value)."""
    slot_mapping: torch.Tensor
    """[num_actual_tokens] int64: the cache slot each new token's key and value go to."""
    num_reqs: int
    num_actual_tokens: int
    """Tokens that belong to requests; the model's input may be padded past this."""
    max_query_len: int
    max_seq_len: int
    num_prompt_tokens: torch.Tensor | None = None
    """[B] int32: each request's prompt length; its tokens from there on are generated ones (a
    decode's, a speculative step's drafts). A backend that computes a row differently by the
    shape of the step may use it to compute generated tokens' rows as a decode step would (see
    kiln-x86's attention). None where the caller does not say (a draft model's steps)."""

    @classmethod
    def from_block_tables(
        cls,
        query_lens: Sequence[int],
        num_computed_tokens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
    ) -> CommonAttentionMetadata:
        """Build the metadata (slot mapping included) from per-request Python lists.

        Args:
            query_lens: new tokens per request, in batch order.
            num_computed_tokens: tokens already cached per request.
            block_tables: each request's block ids; must cover ``computed + new`` tokens.
            block_size: tokens per block.

        Raises:
            ValueError: the lists differ in length, a count is negative, or a block table is too
                short for its request's context.
        """
        num_reqs = len(query_lens)
        if len(num_computed_tokens) != num_reqs or len(block_tables) != num_reqs:
            raise ValueError(
                f"query_lens ({num_reqs}), num_computed_tokens ({len(num_computed_tokens)}) and "
                f"block_tables ({len(block_tables)}) must have one entry per request"
            )
        seq_lens = [c + q for c, q in zip(num_computed_tokens, query_lens, strict=True)]
        for i, (q, c, blocks) in enumerate(
            zip(query_lens, num_computed_tokens, block_tables, strict=True)
        ):
            if q < 0 or c < 0:
                raise ValueError(f"request {i}: query_len={q} and num_computed={c} must be >= 0")
            if len(blocks) * block_size < c + q:
                raise ValueError(
                    f"request {i}: {len(blocks)} blocks of {block_size} cannot hold {c + q} tokens"
                )
        max_num_blocks = max((len(b) for b in block_tables), default=0)
        block_table = torch.zeros(num_reqs, max(max_num_blocks, 1), dtype=torch.int32)
        for i, blocks in enumerate(block_tables):
            block_table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)

        query_lens_t = torch.tensor(query_lens, dtype=torch.int64)
        computed_t = torch.tensor(num_computed_tokens, dtype=torch.int64)
        query_start_loc = torch.zeros(num_reqs + 1, dtype=torch.int64)
        torch.cumsum(query_lens_t, 0, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        # Position of every new token within its request, then its slot.
        req_idx = torch.repeat_interleave(torch.arange(num_reqs), query_lens_t)  # [num_tokens]
        positions = (
            torch.arange(num_tokens) - query_start_loc[req_idx] + computed_t[req_idx]
        )  # [num_tokens]
        block_ids = block_table[req_idx, positions // block_size].to(torch.int64)
        slot_mapping = block_ids * block_size + positions % block_size  # [num_tokens]
        return cls(
            query_start_loc=query_start_loc.to(torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            num_computed_tokens=computed_t.to(torch.int32),
            block_table=block_table,
            slot_mapping=slot_mapping,
            num_reqs=num_reqs,
            num_actual_tokens=num_tokens,
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
        )


class AttentionMetadataBuilder(ABC, Generic[M]):
    """Builds a backend's metadata once per step; the result is shared by every layer.

    Args:
        block_size: tokens per KV cache block.
        device: where the backend's tensors must live.
    """

    def __init__(self, block_size: int, device: torch.device | str = "cpu") -> None:
        self.block_size = block_size
        self.device = torch.device(device)

    @abstractmethod
    def build(self, common: CommonAttentionMetadata) -> M:
        """The backend's metadata for this step. Must not modify ``common``."""


class AttentionImpl(ABC, Generic[M]):
    """One layer's attention computation on a paged KV cache.

    Args:
        num_heads: query heads.
        head_size: dimension of each head.
        scale: multiplier of ``q @ k^T`` (usually ``head_size ** -0.5``).
        num_kv_heads: key/value heads; ``num_heads`` must be a multiple (grouped-query attention:
            query head ``h`` uses kv head ``h // (num_heads // num_kv_heads)``).
        sliding_window: attend only to the last ``sliding_window`` positions, or ``None``.
        logits_soft_cap: if set, each scaled score ``s`` becomes ``cap * tanh(s / cap)`` before
            the mask and the softmax (Gemma 2's ``attn_logit_softcapping``); ``None``: no cap. A
            backend without it refuses it with an error naming the argument.
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap

    @abstractmethod
    def forward(
        self,
        layer: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: M,
    ) -> torch.Tensor:
        """Write the new keys/values into ``kv_cache``, then attend.

        Args:
            layer: the calling ``Attention`` module (for per-layer attributes such as scales).
            query: [num_tokens, num_heads, head_size].
            key: [num_tokens, num_kv_heads, head_size].
            value: [num_tokens, num_kv_heads, head_size].
            kv_cache: this layer's cache, shaped by the backend's ``get_kv_cache_shape``.
            attn_metadata: what the backend's builder built for this step.

        Returns:
            [num_tokens, num_heads * head_size]; rows past ``num_actual_tokens`` are zero.

        Side effects:
            writes the first ``num_actual_tokens`` keys and values into ``kv_cache`` at their slots.
        """


class AttentionBackend(ABC):
    """A family of attention kernels: cache layout, metadata builder and per-layer impl."""

    @staticmethod
    @abstractmethod
    def get_name() -> str:
        """A short name for logs and introspection ("CPU", "FLASH_ATTN")."""

    @staticmethod
    @abstractmethod
    def get_impl_cls() -> type[AttentionImpl[Any]]:
        """The per-layer implementation class."""

    @staticmethod
    @abstractmethod
    def get_metadata_builder_cls() -> type[AttentionMetadataBuilder[Any]]:
        """The per-step metadata builder class."""

    @staticmethod
    @abstractmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """The shape of one layer's KV cache tensor."""


_BACKEND_METHODS = ("get_name", "get_impl_cls", "get_metadata_builder_cls", "get_kv_cache_shape")


def validate_attention_backend(backend_cls: object) -> type[AttentionBackend]:
    """Check that ``backend_cls`` implements ``AttentionBackend``; return it.

    Checks the class hierarchy, that every method is overridden, what ``get_impl_cls`` and
    ``get_metadata_builder_cls`` return, that their constructors and methods accept the interface's
    arguments, and that ``get_kv_cache_shape`` returns a tuple of ints with room for K and V.

    Raises:
        TypeError: the message names the class and what is wrong with it.
    """
    name = getattr(backend_cls, "__qualname__", repr(backend_cls))
    if not (isinstance(backend_cls, type) and issubclass(backend_cls, AttentionBackend)):
        raise TypeError(f"attention backend {name} must subclass AttentionBackend")
    for method in _BACKEND_METHODS:
        if getattr(backend_cls, method) is getattr(AttentionBackend, method):
            raise TypeError(f"attention backend {name} does not implement {method}()")

    impl_cls = backend_cls.get_impl_cls()
    if not (isinstance(impl_cls, type) and issubclass(impl_cls, AttentionImpl)):
        raise TypeError(f"{name}.get_impl_cls() must return an AttentionImpl subclass")
    builder_cls = backend_cls.get_metadata_builder_cls()
    if not (isinstance(builder_cls, type) and issubclass(builder_cls, AttentionMetadataBuilder)):
        raise TypeError(
            f"{name}.get_metadata_builder_cls() must return an AttentionMetadataBuilder subclass"
        )
    _check_accepts(
        impl_cls.__init__,
        (None, 8, 64, 0.125, 2),
        {"sliding_window": None, "logits_soft_cap": None},
        name,
    )
    _check_accepts(impl_cls.forward, (None,) * 7, {}, name)
    _check_accepts(builder_cls.__init__, (None, 16, "cpu"), {}, name)
    _check_accepts(builder_cls.build, (None, None), {}, name)

    shape = backend_cls.get_kv_cache_shape(3, 16, 2, 8)
    if not (isinstance(shape, tuple) and all(isinstance(d, int) for d in shape)):
        raise TypeError(f"{name}.get_kv_cache_shape() must return a tuple of ints, got {shape!r}")
    numel = 1
    for d in shape:
        numel *= d
    if numel < 2 * 3 * 16 * 2 * 8:
        raise TypeError(f"{name}.get_kv_cache_shape(3, 16, 2, 8) = {shape} has no room for K and V")
    kv_cache_block_dim(backend_cls)
    return backend_cls


def kv_cache_block_dim(backend_cls: type[AttentionBackend]) -> int:
    """The dimension of ``backend_cls``'s KV-cache tensor that indexes blocks: the one dimension
    that grows with ``num_blocks``, found by asking its ``get_kv_cache_shape`` twice.

    Raises:
        TypeError: no single dimension is the block count (a copy of whole blocks, as KV
            connectors make, could not index it).
    """
    small = backend_cls.get_kv_cache_shape(3, 16, 2, 8)
    large = backend_cls.get_kv_cache_shape(5, 16, 2, 8)
    dims = [i for i, (a, b) in enumerate(zip(small, large, strict=True)) if a != b]
    if len(dims) != 1 or (small[dims[0]], large[dims[0]]) != (3, 5):
        raise TypeError(
            f"{backend_cls.__qualname__}.get_kv_cache_shape has no block dimension "
            f"(num_blocks 3 -> {small}, 5 -> {large})"
        )
    return dims[0]


def _check_accepts(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], owner: str) -> None:
    try:
        inspect.signature(fn).bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(
            f"attention backend {owner}: {fn.__qualname__}{inspect.signature(fn)} does not accept "
            f"the interface's arguments ({exc})"
        ) from None
