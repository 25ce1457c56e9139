"""Attention test fixtures: ``make_sim`` builds a ``PagedSim``, a small paged-KV simulator.

It plays the model runner's part for one ``Attention`` layer: hands out shuffled block ids, builds
``CommonAttentionMetadata`` for a step, runs the layer inside a forward context, and keeps each
request's keys and values in contiguous tensors so the dense reference can be computed.
"""

from __future__ import annotations

import random

import pytest
import torch

from kiln.forward_context import ForwardContext, set_forward_context
from kiln.model_executor.layers.attention import Attention, CommonAttentionMetadata
from kiln.model_executor.layers.attention.backends.cpu import CPUAttentionBackend
from kiln.model_executor.layers.attention.backends.torch_ref import ref_attention

# Unwritten slots hold this: large enough that reading one unmasked wrecks the output.
SENTINEL = 50.0


class PagedSim:
    def __init__(
        self,
        num_heads: int = 9,
        num_kv_heads: int = 3,
        head_size: int = 64,
        block_size: int = 16,
        num_blocks: int = 64,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        backend: type = CPUAttentionBackend,
    ) -> None:
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.block_size = block_size
        self.dtype = dtype
        self.scale = head_size**-0.5
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.gen = torch.Generator().manual_seed(seed)
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        shape = backend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
        self.kv_cache = torch.full(shape, SENTINEL, dtype=dtype)
        self.layer = Attention(
            num_heads,
            head_size,
            self.scale,
            num_kv_heads,
            prefix="model.layers.0.self_attn.attn",
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
            backend=backend,
        )
        self.layer.kv_cache = self.kv_cache
        self.builder = backend.get_metadata_builder_cls()(block_size, "cpu")
        self.blocks: dict[str, list[int]] = {}
        self.keys: dict[str, torch.Tensor] = {}  # [num_computed, Hkv, D]
        self.values: dict[str, torch.Tensor] = {}
        self.written_slots: set[int] = set()

    def add_prefix_hit(self, req_id: str, src_id: str, num_blocks: int) -> None:
        """Start ``req_id`` with ``src_id``'s first ``num_blocks`` full blocks already cached."""
        num_tokens = num_blocks * self.block_size
        assert self.keys[src_id].shape[0] >= num_tokens
        self.blocks[req_id] = self.blocks[src_id][:num_blocks]
        self.keys[req_id] = self.keys[src_id][:num_tokens]
        self.values[req_id] = self.values[src_id][:num_tokens]

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(self.dtype)

    def make_inputs(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (
            self.randn(num_tokens, self.num_heads, self.head_size),
            self.randn(num_tokens, self.num_kv_heads, self.head_size),
            self.randn(num_tokens, self.num_kv_heads, self.head_size),
        )

    def step(
        self,
        schedule: dict[str, int],
        inputs: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None,
        num_padding: int = 0,
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor]:
        """Run one step; return (outputs, reference outputs) per request and the raw output.

        ``schedule`` maps request id -> new tokens, in batch order. ``inputs`` optionally gives a
        request's (query, key, value); otherwise they are random.
        """
        inputs = dict(inputs or {})
        query_lens, computed, tables = [], [], []
        for req_id, num_new in schedule.items():
            num_cached = self.keys[req_id].shape[0] if req_id in self.keys else 0
            blocks = self.blocks.setdefault(req_id, [])
            while len(blocks) * self.block_size < num_cached + num_new:
                blocks.append(self.free_blocks.pop())
            if req_id not in inputs:
                inputs[req_id] = self.make_inputs(num_new)
            query_lens.append(num_new)
            computed.append(num_cached)
            tables.append(list(blocks))
        common = CommonAttentionMetadata.from_block_tables(
            query_lens, computed, tables, self.block_size
        )
        q, k, v = (torch.cat([inputs[r][i] for r in schedule]) for i in range(3))
        if num_padding:
            q, k, v = (torch.cat([t, self.randn(num_padding, *t.shape[1:])]) for t in (q, k, v))
        metadata = self.builder.build(common)
        # As models pass them: views of one fused qkv projection (strided rows).
        qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
        q_size, kv_size = q[0].numel(), k[0].numel()
        with set_forward_context(ForwardContext(metadata, num_tokens=q.shape[0])):
            out = self.layer(*qkv.split([q_size, kv_size, kv_size], dim=1))
        out = out.view(-1, self.num_heads, self.head_size)

        outputs, refs = {}, {}
        start = 0
        for req_id, num_new in schedule.items():
            rq, rk, rv = inputs[req_id]
            self.keys[req_id] = torch.cat([self.keys.get(req_id, rk[:0]), rk])
            self.values[req_id] = torch.cat([self.values.get(req_id, rv[:0]), rv])
            outputs[req_id] = out[start : start + num_new]
            refs[req_id] = ref_attention(
                rq,
                self.keys[req_id],
                self.values[req_id],
                self.scale,
                self.sliding_window,
                self.logits_soft_cap,
            )
            start += num_new
        self.written_slots.update(common.slot_mapping.tolist())
        return outputs, refs, out

    def check_cache(self) -> None:
        """Every request's history sits at its slots; no other slot was written."""
        key_cache = self.kv_cache[0].reshape(-1, self.num_kv_heads, self.head_size)
        value_cache = self.kv_cache[1].reshape(-1, self.num_kv_heads, self.head_size)
        expected: set[int] = set()
        for req_id, keys in self.keys.items():
            positions = torch.arange(keys.shape[0])
            table = torch.tensor(self.blocks[req_id])
            slots = table[positions // self.block_size] * self.block_size + positions % (
                self.block_size
            )
            torch.testing.assert_close(key_cache[slots], keys, rtol=0, atol=0)
            torch.testing.assert_close(value_cache[slots], self.values[req_id], rtol=0, atol=0)
            expected.update(slots.tolist())
        assert self.written_slots == expected
        untouched = torch.ones(key_cache.shape[0], dtype=torch.bool)
        untouched[list(expected)] = False
        assert bool((key_cache[untouched] == SENTINEL).all())
        assert bool((value_cache[untouched] == SENTINEL).all())


@pytest.fixture
def make_sim() -> type[PagedSim]:
    """The ``PagedSim`` class: ``make_sim(num_heads, num_kv_heads, head_size, block_size, ...)``."""
    return PagedSim
