"""BlockPool: null block, LRU free queue, touch, eviction of cached hashes, usage."""

import pytest

from kiln.scheduler.kv_cache import NULL_BLOCK_ID, BlockPool


def test_null_block_is_never_handed_out():
    pool = BlockPool(5, enable_caching=True)
    assert pool.num_usable_blocks == 4 and pool.get_num_free_blocks() == 4
    blocks = pool.get_new_blocks(4)
    assert NULL_BLOCK_ID not in [b.block_id for b in blocks]
    assert sorted(b.block_id for b in blocks) == [1, 2, 3, 4]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.usage == 1.0
    with pytest.raises(ValueError, match="only 0 are free"):
        pool.get_new_blocks(1)
    with pytest.raises(ValueError, match="num_blocks=1"):
        BlockPool(1, enable_caching=True)


def test_freed_blocks_are_reused_least_recently_freed_first():
    pool = BlockPool(5, enable_caching=True)
    a, b, c, d = pool.get_new_blocks(4)
    pool.free_blocks([c, a])
    pool.free_blocks([d])
    assert pool.usage == 0.25
    assert [blk.block_id for blk in pool.get_new_blocks(3)] == [c.block_id, a.block_id, d.block_id]


def test_eviction_forgets_the_hash_and_touch_revives_a_free_cached_block():
    pool = BlockPool(4, enable_caching=True)
    a, b, c = pool.get_new_blocks(3)
    assert pool.cache_block(a, 111) and pool.cache_block(b, 222)
    assert not pool.cache_block(c, 111)  # Another block holds the hash: c stays a plain block.
    assert not pool.cache_block(a, 333)  # Already cached.
    pool.free_blocks([b, a, c])
    assert pool.get_num_free_blocks() == 3 and pool.num_cached_blocks == 2
    # A hit on a: it leaves the free queue, so it can't be evicted.
    assert pool.get_cached_block(111) is a
    pool.touch([a])
    assert a.ref_cnt == 1 and pool.get_num_free_blocks() == 2
    # b is at the head: taking one block evicts it from the cache.
    (taken,) = pool.get_new_blocks(1)
    assert taken is b and b.block_hash is None and pool.get_cached_block(222) is None
    assert pool.get_cached_block(111) is a
    pool.touch([a])
    assert a.ref_cnt == 2
    pool.free_blocks([a])
    pool.free_blocks([a])
    assert a.ref_cnt == 0 and pool.get_num_free_blocks() == 2


def test_caching_disabled_and_reset():
    pool = BlockPool(3, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    assert not pool.cache_block(a, 1) and pool.get_cached_block(1) is None
    pool = BlockPool(3, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, 1)
    pool.cache_block(b, 2)
    pool.free_blocks([a])
    assert pool.reset_prefix_cache() == 2
    assert a.block_hash is None and b.block_hash is None and pool.num_cached_blocks == 0
