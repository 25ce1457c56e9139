"""The block pool: every KV-cache block's bookkeeping, with no tensors behind it.

Contract:
- A block is free when no request holds it (``ref_cnt == 0``). Free blocks wait in a queue ordered
  from "evict first" (head) to "evict last" (tail); ``get_new_blocks`` takes from the head and
  ``free_blocks`` appends to the tail, so cached blocks are evicted least recently used first.
- A free block may still be *cached*: it keeps its ``block_hash`` and stays in the hash map until
  ``get_new_blocks`` reuses it (eviction). ``touch`` revives a cached free block on a prefix hit.
- Block 0 is the *null block*: never handed out, never freed, never cached. Model runners may point
  padding entries of a block table (and padding slots) at it; every other block id is usable.

This module knows nothing about requests, tokens or tensors: the KV-cache manager owns those, and
the model runner owns the memory the block ids index.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

NULL_BLOCK_ID = 0
"""The reserved block id (see the module docstring)."""


class KVCacheBlock:
    """One block's metadata."""

    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        """Requests holding the block; 0 means it is in the free queue."""
        self.block_hash: int | None = None
        """Prefix hash of its tokens while the block is in the cache, else None."""

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={self.block_hash})"


class BlockPool:
    """Blocks with reference counts, an LRU free queue and a ``block_hash -> block`` cache map.

    Args:
        num_blocks: blocks in the KV cache, the null block included (so at least 2).
        enable_caching: keep the hashes of full blocks so later requests can share them.

    Raises:
        ValueError: ``num_blocks < 2``.
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks} is invalid; allowed: an integer >= 2")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.null_block.ref_cnt = 1  # Held forever, so it is never in the free queue.
        # block_id -> block, head = next to evict. OrderedDict gives O(1) popleft, append and
        # removal from the middle (for touch) in C.
        self._free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (block.block_id, block) for block in self.blocks[1:]
        )
        self._cached_blocks: dict[int, KVCacheBlock] = {}

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can hold tokens (all but the null block)."""
        return self.num_blocks - 1

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the prefix cache, held or free."""
        return len(self._cached_blocks)

    def get_num_free_blocks(self) -> int:
        """Blocks no request holds (cached or not): what ``get_new_blocks`` can hand out."""
        return len(self._free_queue)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests, 0..1 (cached free blocks count as free)."""
        return 1.0 - len(self._free_queue) / self.num_usable_blocks

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        """The cached block with ``block_hash``, held or free, or None. No side effects."""
        return self._cached_blocks.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the head of the free queue, each with ``ref_cnt = 1``.

        Raises:
            ValueError: fewer than ``num_blocks`` free blocks.

        Side effects: evicts the taken blocks from the cache (their hashes are forgotten).
        """
        if num_blocks > len(self._free_queue):
            raise ValueError(
                f"cannot take {num_blocks} blocks: only {len(self._free_queue)} are free"
            )
        popitem = self._free_queue.popitem
        blocks = []
        for _ in range(num_blocks):
            block = popitem(last=False)[1]
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Hold ``blocks`` once more (a prefix-cache hit).

        Side effects: ``ref_cnt += 1``; a block that was free leaves the free queue (it can no
        longer be evicted).
        """
        free_queue = self._free_queue
        for block in blocks:
            if block.ref_cnt == 0:
                del free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Release one hold on each block; blocks nobody holds join the tail of the free queue
        in the given order (first given = evicted first).

        Side effects: ``ref_cnt -= 1``; cached blocks stay cached until evicted.
        """
        free_queue = self._free_queue
        for block in ordered_blocks:
            assert block.ref_cnt > 0 and block is not self.null_block, block
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                free_queue[block.block_id] = block

    def cache_block(self, block: KVCacheBlock, block_hash: int) -> bool:
        """Put a full, held block in the cache under ``block_hash``.

        Returns:
            False (and changes nothing) when caching is off, the block is already cached, or
            another block already holds this hash (two requests computed the same prefix at
            once; the first stays the cached copy and this one is freed as a plain block).
        """
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self._cached_blocks:
            return False
        assert block.ref_cnt > 0, block
        block.block_hash = block_hash
        self._cached_blocks[block_hash] = block
        return True

    def uncache_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop ``blocks`` from the cache (those not cached are skipped); they stay held."""
        for block in blocks:
            if block.block_hash is not None:
                self._evict(block)

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash (held blocks keep their contents but are no longer shared).

        Returns:
            The number of blocks dropped from the cache.
        """
        num_dropped = len(self._cached_blocks)
        for block in self._cached_blocks.values():
            block.block_hash = None
        self._cached_blocks.clear()
        return num_dropped

    def _evict(self, block: KVCacheBlock) -> None:
        block_hash = block.block_hash
        assert block_hash is not None
        if self._cached_blocks.get(block_hash) is block:
            del self._cached_blocks[block_hash]
        block.block_hash = None
