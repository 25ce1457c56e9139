"""Model test fixtures: ``PagedRunner`` drives a Kiln model through a paged KV cache.

It plays the model runner's part in miniature: allocates one KV cache per attention layer and binds
it, hands out block ids from a shuffled free list (so block tables are never contiguous), builds
``CommonAttentionMetadata`` and the backend's metadata for each step, runs the model inside a
forward context, and computes logits for the last token of each request only.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import torch

from kiln.forward_context import ForwardContext, set_forward_context
from kiln.model_executor.layers.attention import (
    CommonAttentionMetadata,
    bind_kv_cache,
    get_attn_backend,
)


class PagedRunner:
    """Runs ``model`` step by step over a paged KV cache; one instance per model under test.

    Args:
        model: a Kiln model (``forward``, ``compute_logits``, ``attention_layers``).
        block_size: tokens per block (small, so requests span many blocks).
        num_blocks: blocks in each layer's cache.
        seed: shuffles the free block list.
    """

    def __init__(
        self, model: torch.nn.Module, block_size: int = 4, num_blocks: int = 256, seed: int = 0
    ) -> None:
        self.model = model
        self.block_size = block_size
        backend = get_attn_backend()
        layers = model.attention_layers()
        first = next(iter(layers.values()))
        shape = backend.get_kv_cache_shape(
            num_blocks, block_size, first.num_kv_heads, first.head_size
        )
        dtype = next(model.parameters()).dtype
        # Unwritten slots hold a large finite value: reading one unmasked wrecks the logits.
        self.kv_caches = {name: torch.full(shape, 50.0, dtype=dtype) for name in layers}
        self.builder = backend.get_metadata_builder_cls()(block_size, "cpu")
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.block_tables: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}

    def step(
        self, batch: Sequence[tuple[str, Sequence[int]]], return_hidden: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Compute ``(request id, new token ids)`` for each request; new ids start a request.

        Returns:
            [len(batch), vocab] float32 logits of each request's last new token, and with
            ``return_hidden`` also the hidden states [num_tokens, hidden] of every new token.
        """
        query_lens, computed, tables, ids, positions = [], [], [], [], []
        for req_id, tokens in batch:
            start = self.num_computed.setdefault(req_id, 0)
            table = self.block_tables.setdefault(req_id, [])
            while len(table) * self.block_size < start + len(tokens):
                table.append(self.free_blocks.pop())
            query_lens.append(len(tokens))
            computed.append(start)
            tables.append(table)
            ids.extend(tokens)
            positions.extend(range(start, start + len(tokens)))
        common = CommonAttentionMetadata.from_block_tables(
            query_lens, computed, tables, self.block_size
        )
        metadata = self.builder.build(common)
        # Several runners may share one model: bind this runner's caches for the step.
        bind_kv_cache(self.model, self.kv_caches)
        with (
            torch.inference_mode(),
            set_forward_context(ForwardContext(attn_metadata=metadata, num_tokens=len(ids))),
        ):
            hidden = self.model(torch.tensor(ids), torch.tensor(positions))
            last = common.query_start_loc[1:].to(torch.int64) - 1
            logits = self.model.compute_logits(hidden[last])
        for req_id, tokens in batch:
            self.num_computed[req_id] += len(tokens)
        return (logits, hidden) if return_hidden else logits

    def free(self, req_id: str) -> None:
        self.free_blocks.extend(self.block_tables.pop(req_id))
        del self.num_computed[req_id]

    def greedy(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy continuations of ``prompts``, batched: one prefill step, then one-token decode
        steps for every request together."""
        req_ids = [f"greedy-{i}" for i in range(len(prompts))]
        logits = self.step(list(zip(req_ids, prompts, strict=True)))
        outputs: list[list[int]] = [[] for _ in prompts]
        for _ in range(max_new_tokens):
            next_ids = logits.argmax(-1).tolist()
            for out, token in zip(outputs, next_ids, strict=True):
                out.append(token)
            if len(outputs[0]) == max_new_tokens:
                break
            logits = self.step([(r, [t]) for r, t in zip(req_ids, next_ids, strict=True)])
        for req_id in req_ids:
            self.free(req_id)
        return outputs


@pytest.fixture(scope="session")
def paged_runner() -> type[PagedRunner]:
    """The ``PagedRunner`` class (fixtures, not imports, share helpers between test modules)."""
    return PagedRunner
