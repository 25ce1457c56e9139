"""The KV-cache manager: which blocks each request holds, and the prefix cache over them.

Contract:
- A request's *block table* is a list of blocks covering its first ``num_computed_tokens`` plus
  the tokens being computed this step; slot ``t`` of the request is slot ``t % block_size`` of
  block ``t // block_size``.
- ``get_computed_blocks`` looks up the longest cached prefix of a request that is not yet in the
  cache (no side effects); ``allocate_slots`` takes those blocks plus fresh ones and registers every
  block that becomes full in the prefix cache; ``free`` returns them.
- A cached block is registered when it is allocated for the step that computes its last token: the
  runner writes a step's keys and values before any attention reads them, so a request scheduled in
  the same step may share it.
- Stats count tokens: each admitted request queries its ``num_tokens`` and hits what came from the
  cache.

The manager works on ``Request`` objects and block ids only: it knows nothing about tensors (the
model runner owns the memory), sampling or scheduling policy. It builds without any device, so tests
simulate it directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from kiln.scheduler.kv_cache.block_pool import BlockPool, KVCacheBlock
from kiln.scheduler.kv_cache.prefix_hash import new_root_hash, update_block_hashes
from kiln.scheduler.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PrefixMatch(NamedTuple):
    """What ``get_computed_blocks`` found: unpacks as ``(blocks, num_computed_tokens)``."""

    blocks: list[KVCacheBlock]
    """Cached blocks of the request's prefix, in order (not yet held by the request)."""
    num_computed_tokens: int
    """``len(blocks) * block_size``: tokens the request need not compute."""


@dataclass
class PrefixCacheStats:
    num_queries: int = 0
    """Tokens of admitted requests looked up in the prefix cache."""
    num_hits: int = 0
    """Of those, tokens found in the cache."""


class KVCacheManager:
    """Block tables of requests over a ``BlockPool``, with prefix caching.

    Args:
        num_blocks: blocks in the KV cache, the reserved null block (id 0) included.
        block_size: token slots per block.
        enable_caching: share full blocks between requests with equal prefixes.
        max_model_len: the longest request (prompt + output), for ``max_num_blocks_per_req``.
        root_hash: parent hash of every first block; None picks a random one (tests fix it).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool,
        max_model_len: int,
        root_hash: int | None = None,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        self.root_hash = new_root_hash() if root_hash is None else root_hash
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self._req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request id -> leading blocks of its table already registered in the cache (or skipped).
        self._num_cached_blocks: dict[str, int] = {}
        self._stats = PrefixCacheStats()

    # -- sizes ---------------------------------------------------------------------------------

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can hold tokens (all but the null block)."""
        return self.block_pool.num_usable_blocks

    @property
    def max_num_blocks_per_req(self) -> int:
        """Width of a block table for a request of ``max_model_len`` tokens."""
        return cdiv(self.max_model_len, self.block_size)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests, 0..1."""
        return self.block_pool.usage

    def get_num_free_blocks(self) -> int:
        """Blocks no request holds (including cached blocks that may be evicted)."""
        return self.block_pool.get_num_free_blocks()

    def get_block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block table as ids ([] for a request that holds none)."""
        return [block.block_id for block in self._req_to_blocks.get(request_id, ())]

    # -- the cache -----------------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> PrefixMatch:
        """The longest cached prefix of ``request``, in whole blocks.

        The last token is never a hit (a cached block may hold it, but the model must compute it
        to produce logits), so at most ``(num_tokens - 1) // block_size`` blocks are returned.

        Returns:
            ``PrefixMatch([], 0)`` when caching is off.

        Side effects: extends ``request.block_hashes``; the cache, the pool and the stats are
        unchanged (``allocate_slots`` holds the blocks and counts the hit).
        """
        if not self.enable_caching:
            return PrefixMatch([], 0)
        block_hashes = update_block_hashes(request, self.block_size, self.root_hash)
        max_num_blocks = (request.num_tokens - 1) // self.block_size
        get_cached_block = self.block_pool.get_cached_block
        blocks: list[KVCacheBlock] = []
        for block_hash in block_hashes[:max_num_blocks]:
            block = get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return PrefixMatch(blocks, len(blocks) * self.block_size)

    def can_allocate(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> bool:
        """Whether ``allocate_slots`` with the same arguments would succeed. No side effects."""
        return self._get_num_new_blocks(request, num_new_tokens, new_computed_blocks) is not None

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
        delay_caching: bool = False,
    ) -> list[int] | None:
        """Grow ``request``'s block table to cover its computed tokens, the prefix hit,
        ``num_new_tokens`` more and ``num_lookahead_tokens`` slots after them.

        Args:
            request: its ``num_computed_tokens`` counts the tokens already in its blocks.
            num_new_tokens: tokens to compute this step (> 0).
            num_new_computed_tokens: tokens of ``new_computed_blocks`` (a prefix hit).
            new_computed_blocks: ``get_computed_blocks(request).blocks``, for a request that holds
                no blocks yet.
            num_lookahead_tokens: slots a draft model writes after the new tokens (never
                cached: they hold no token of the request yet).
            delay_caching: register no new block in the prefix cache (the new tokens' KV is
                still loading asynchronously); a later allocation registers them.

        Returns:
            The ids appended to the block table (hit blocks, then fresh ones; often empty), or
            None when too few blocks are free; then nothing changed.

        Side effects: holds the hit blocks (``touch``) and takes fresh ones (evicting the least
        recently used cached blocks); registers every block that becomes full in the prefix
        cache; on a request's first allocation, counts its prefix-cache query and hit.
        """
        num_new_blocks = self._get_num_new_blocks(
            request, num_new_tokens + num_lookahead_tokens, new_computed_blocks
        )
        if num_new_blocks is None:
            return None
        request_id = request.request_id
        blocks = self._req_to_blocks.get(request_id)
        if blocks is None:
            blocks = self._req_to_blocks[request_id] = []
            self._num_cached_blocks[request_id] = 0
            if self.enable_caching:
                self._stats.num_queries += request.num_tokens
                self._stats.num_hits += num_new_computed_tokens
        num_old_blocks = len(blocks)
        if new_computed_blocks:
            assert num_old_blocks == 0, "a prefix hit is for a request without blocks"
            assert num_new_computed_tokens == len(new_computed_blocks) * self.block_size
            self.block_pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            # Hit blocks are cached already.
            self._num_cached_blocks[request_id] = len(new_computed_blocks)
        if num_new_blocks > 0:
            blocks.extend(self.block_pool.get_new_blocks(num_new_blocks))
        if self.enable_caching and not delay_caching:
            num_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
            self._cache_full_blocks(request, blocks, min(num_tokens, request.num_tokens))
        return [block.block_id for block in blocks[num_old_blocks:]]

    def free(self, request: Request) -> None:
        """Release the request's blocks; unknown requests are ignored.

        Side effects: blocks nobody else holds go to the free queue, the request's last block
        first, so its tail is evicted before its head (a later request is likelier to share the
        head). Cached blocks stay cached until evicted.
        """
        blocks = self._req_to_blocks.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def uncache(self, request: Request, num_tokens_kept: int) -> None:
        """Drop from the prefix cache the request's blocks past its first ``num_tokens_kept``
        tokens (the step that computed them failed for it: nobody may share what they hold).

        Side effects: those blocks lose their hashes, also for other requests holding them.
        """
        blocks = self._req_to_blocks.get(request.request_id, [])
        self.block_pool.uncache_blocks(blocks[num_tokens_kept // self.block_size :])

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix. Returns the number of blocks dropped from the cache.

        Side effects: running requests keep their blocks, but nobody can share them any more.
        """
        return self.block_pool.reset_prefix_cache()

    def take_prefix_cache_stats(self) -> PrefixCacheStats:
        """The stats since the last call (which are then reset)."""
        stats, self._stats = self._stats, PrefixCacheStats()
        return stats

    # -- internals -----------------------------------------------------------------------------

    def _get_num_new_blocks(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None,
    ) -> int | None:
        """Fresh blocks the allocation needs, or None when the pool cannot provide them."""
        assert num_new_tokens > 0, num_new_tokens
        num_held_blocks = len(self._req_to_blocks.get(request.request_id, ()))
        num_hit_blocks = len(new_computed_blocks) if new_computed_blocks else 0
        num_tokens = request.num_computed_tokens + num_hit_blocks * self.block_size + num_new_tokens
        num_new_blocks = cdiv(num_tokens, self.block_size) - num_held_blocks - num_hit_blocks
        num_available = self.block_pool.get_num_free_blocks()
        if new_computed_blocks:  # i.e. num_hit_blocks > 0
            # Hit blocks that are free leave the free queue when touched.
            num_available -= sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        return num_new_blocks if num_new_blocks <= num_available else None

    def _cache_full_blocks(
        self, request: Request, blocks: list[KVCacheBlock], num_tokens: int
    ) -> None:
        """Register the blocks that are full once ``num_tokens`` tokens are computed."""
        request_id = request.request_id
        num_cached = self._num_cached_blocks[request_id]
        num_full = num_tokens // self.block_size
        if num_full <= num_cached:
            return
        block_hashes = update_block_hashes(request, self.block_size, self.root_hash, num_tokens)
        cache_block = self.block_pool.cache_block
        for i in range(num_cached, num_full):
            cache_block(blocks[i], block_hashes[i])
        self._num_cached_blocks[request_id] = num_full
