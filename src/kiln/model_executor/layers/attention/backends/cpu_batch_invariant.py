"""The CPU attention backend in batch-invariant mode: a request's attention does not depend on the
other requests of the step.

The plain CPU backend (``cpu``) pads every decode's context to the longest one in the step, and the
bf16 ``probs @ v`` product rounds differently for another padded length even though the padding
adds zeros: a request's output then depends on who else is decoding. Here each decode is padded
to a length that depends on that request alone, its number of blocks rounded up to a power of two,
and decodes with the same padded length are attended together in one call (the batched products
give each batch entry the same result for any number of entries). A step of decodes of similar
length still makes one call; a step whose lengths span 2^k blocks makes at most k + 1.

Prefills already attend one request at a time, over exactly its own context. Everything else
(cache layout, cache writes, prefills, metadata) is the ``cpu`` backend's. This module knows
nothing about models, platforms or configs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kiln.model_executor.layers.attention.backend import CommonAttentionMetadata
from kiln.model_executor.layers.attention.backends.cpu import (
    CPUAttentionBackend,
    CPUAttentionImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)


@dataclass
class CPUBatchInvariantAttentionMetadata(CPUAttentionMetadata):
    """The ``cpu`` metadata plus the decodes split into groups of one padded length."""

    decode_groups: list[tuple[torch.Tensor, CPUAttentionMetadata]] = field(default_factory=list)
    """``(positions, metadata)`` per padded length: ``positions`` [n] int64 are the group's
    indices among the step's decodes; ``metadata`` holds their decode fields alone."""


class CPUBatchInvariantAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    """Builds the ``cpu`` metadata, then groups the decodes by their own padded length."""

    def build(self, common: CommonAttentionMetadata) -> CPUBatchInvariantAttentionMetadata:
        md = CPUBatchInvariantAttentionMetadata(**vars(super().build(common)))
        if not md.num_decodes:
            return md
        assert md.decode_seq_lens is not None and md.decode_block_ids is not None
        assert md.decode_token_idx is not None
        block_size = self.block_size
        table = md.decode_block_ids.view(md.num_decodes, -1)  # [num_decodes, max_blocks]
        num_blocks = (md.decode_seq_lens + block_size - 1) // block_size  # [num_decodes]
        # Next power of two >= num_blocks: a length chosen by the request alone.
        padded = torch.pow(2, torch.ceil(torch.log2(num_blocks.double()))).to(torch.int64)
        for length in sorted(set(padded.tolist())):
            positions = torch.nonzero(padded == length).flatten()  # [n]
            seq_lens = md.decode_seq_lens[positions]
            group_table = torch.zeros(len(positions), length, dtype=torch.int64)
            width = min(length, table.shape[1])
            group_table[:, :width] = table[positions, :width]  # past a request's blocks: masked
            slots = torch.arange(length * block_size)
            group = CPUAttentionMetadata(
                num_actual_tokens=md.num_actual_tokens,
                slot_mapping=md.slot_mapping,
                num_decodes=len(positions),
                decode_token_idx=md.decode_token_idx[positions],
                decode_block_ids=group_table.flatten(),
                decode_seq_lens=seq_lens,
                decode_mask=(slots[None, :] < seq_lens[:, None])[:, None, None, :],
                workspace=md.workspace,
            )
            md.decode_groups.append((positions, group))
        return md


class CPUBatchInvariantAttentionImpl(CPUAttentionImpl):
    """The ``cpu`` implementation with decodes attended per padded-length group."""

    def _decode(
        self,
        md: CPUAttentionMetadata,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
    ) -> torch.Tensor:
        """[num_decodes, num_heads, D], each decode padded to its own length."""
        assert isinstance(md, CPUBatchInvariantAttentionMetadata)
        out = query.new_empty(md.num_decodes, self.num_heads, self.head_size)
        for positions, group in md.decode_groups:
            out.index_copy_(0, positions, super()._decode(group, query, key_cache, value_cache))
        return out


class CPUBatchInvariantAttentionBackend(CPUAttentionBackend):
    """The cpu platform's attention backend under ``model.batch_invariant``."""

    @staticmethod
    def get_name() -> str:
        return "CPU_BATCH_INVARIANT"

    @staticmethod
    def get_impl_cls() -> type[CPUAttentionImpl]:
        return CPUBatchInvariantAttentionImpl

    @staticmethod
    def get_metadata_builder_cls() -> type[CPUAttentionMetadataBuilder]:
        return CPUBatchInvariantAttentionMetadataBuilder
