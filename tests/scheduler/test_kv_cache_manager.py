"""KVCacheManager: prefix hashing, hits, allocation, freeing order, stats (no tensors)."""

from kiln.sampling_params import SamplingParams
from kiln.scheduler.kv_cache import KVCacheManager, hash_block_tokens, update_block_hashes
from kiln.scheduler.request import Request

BLOCK_SIZE = 4


def _manager(num_blocks: int = 11, enable_caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching, max_model_len=64, root_hash=7)


def _req(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, list(prompt), SamplingParams())


def _run_prefill(manager: KVCacheManager, request: Request) -> list[int]:
    """Admit a request like the scheduler does and mark its prompt computed."""
    blocks, num_hit_tokens = manager.get_computed_blocks(request)
    num_new_tokens = request.num_tokens - num_hit_tokens
    block_ids = manager.allocate_slots(request, num_new_tokens, num_hit_tokens, blocks)
    assert block_ids is not None
    request.num_computed_tokens = request.num_tokens
    return block_ids


def test_block_hashes_are_chained_incremental_and_cover_output_tokens():
    request = _req("a", list(range(10)))
    hashes = update_block_hashes(request, BLOCK_SIZE, root_hash=7)
    h0 = hash_block_tokens(7, [0, 1, 2, 3])
    assert hashes == [h0, hash_block_tokens(h0, [4, 5, 6, 7])]
    request.output_token_ids += [10, 11, 12]
    update_block_hashes(request, BLOCK_SIZE, root_hash=7)
    fresh = _req("b", list(range(13)))
    assert request.block_hashes == update_block_hashes(fresh, BLOCK_SIZE, root_hash=7)
    assert len(request.block_hashes) == 3
    # The same block after a different prefix hashes differently.
    other = _req("c", [9, 9, 9, 9, 4, 5, 6, 7])
    update_block_hashes(other, BLOCK_SIZE, root_hash=7)
    assert other.block_hashes[1] != request.block_hashes[1]


def test_hit_is_the_longest_cached_prefix_but_never_the_whole_prompt():
    manager = _manager()
    first = _req("first", list(range(12)))  # Exactly 3 full blocks.
    first_ids = _run_prefill(manager, first)
    assert len(first_ids) == 3
    same = _req("same", list(range(12)))
    blocks, num_hit_tokens = manager.get_computed_blocks(same)
    # The last prompt token must be computed, so its block is not a hit.
    assert num_hit_tokens == 8 and [b.block_id for b in blocks] == first_ids[:2]
    longer = _req("longer", list(range(12)) + [50, 51])
    assert manager.get_computed_blocks(longer).num_computed_tokens == 12
    diverging = _req("diverging", [0, 1, 2, 3, 4, 5, 99, 7, 8, 9, 10, 11, 12])
    assert manager.get_computed_blocks(diverging).num_computed_tokens == 4
    # get_computed_blocks changes nothing: no ref taken, no stats.
    assert all(b.ref_cnt == 1 for b in blocks)
    manager.take_prefix_cache_stats()
    ids = _run_prefill(manager, longer)
    assert ids[:3] == first_ids and len(ids) == 4
    assert all(b.ref_cnt == 2 for b in blocks)
    stats = manager.take_prefix_cache_stats()
    assert (stats.num_queries, stats.num_hits) == (14, 12)
    assert manager.take_prefix_cache_stats().num_queries == 0


def test_allocate_fails_without_changing_anything_and_counts_free_hit_blocks():
    manager = _manager(num_blocks=5)  # 4 usable blocks.
    first = _req("first", list(range(12)))
    _run_prefill(manager, first)
    manager.free(first)
    assert manager.get_num_free_blocks() == 4 and manager.usage == 0.0
    # 2 hit blocks (free, cached) + 3 fresh blocks for 12 more tokens = 5 > 4.
    big = _req("big", list(range(20)))
    blocks, num_hit_tokens = manager.get_computed_blocks(big)
    assert num_hit_tokens == 12
    assert not manager.can_allocate(big, 9, blocks)
    assert manager.allocate_slots(big, 8, num_hit_tokens, blocks) is None
    assert manager.get_block_ids("big") == [] and manager.get_num_free_blocks() == 4
    assert all(b.ref_cnt == 0 for b in blocks)
    assert manager.allocate_slots(big, 4, num_hit_tokens, blocks) is not None
    assert manager.usage == 1.0


def test_running_request_grows_by_a_block_only_when_a_block_fills():
    manager = _manager()
    request = _req("a", list(range(6)))
    assert len(_run_prefill(manager, request)) == 2
    request.output_token_ids.append(100)  # 7 tokens, 6 computed.
    assert manager.allocate_slots(request, 1) == []
    request.num_computed_tokens += 1
    request.output_token_ids.append(101)
    assert manager.allocate_slots(request, 1) == []  # Token 8 fills block 1: now cached.
    assert len(request.block_hashes) == 2
    request.num_computed_tokens += 1
    request.output_token_ids.append(102)
    assert len(manager.allocate_slots(request, 1)) == 1
    assert len(manager.get_block_ids("a")) == 3
    # Output tokens are shared like prompt tokens.
    follower = _req("b", list(range(6)) + [100, 101, 102])
    assert manager.get_computed_blocks(follower).num_computed_tokens == 8


def test_freed_tail_blocks_are_evicted_before_the_head():
    manager = _manager(num_blocks=6)  # 5 usable blocks.
    a = _req("a", list(range(16)))
    a_ids = _run_prefill(manager, a)
    manager.free(a)
    # The never-used block is at the head, then a's blocks tail first.
    other = _req("other", [500, 501, 502])
    (other_id,) = _run_prefill(manager, other)
    assert other_id not in a_ids
    other2 = _req("other2", [600, 601, 602, 603])
    assert _run_prefill(manager, other2) == [a_ids[3]]  # a's tail is evicted first.
    probe = _req("probe", list(range(16)) + [1])
    assert manager.get_computed_blocks(probe).num_computed_tokens == 12
    manager.free(other2)
    manager.free(other)
    # LRU: blocks freed longest ago are reused first; a's head is the last of a's to go.
    reused = [b.block_id for b in manager.block_pool.get_new_blocks(5)]
    assert reused == [a_ids[2], a_ids[1], a_ids[0], a_ids[3], other_id]
    assert manager.block_pool.num_cached_blocks == 0


def test_free_is_idempotent_and_shared_blocks_survive_until_last_holder():
    manager = _manager()
    a = _req("a", list(range(9)))
    b = _req("b", list(range(9)))
    a_ids = _run_prefill(manager, a)
    b_ids = _run_prefill(manager, b)
    assert b_ids[:2] == a_ids[:2] and b_ids[2] != a_ids[2]
    manager.free(a)
    manager.free(a)
    assert manager.get_num_free_blocks() == 10 - 3
    manager.free(b)
    assert manager.get_num_free_blocks() == 10 and manager.usage == 0.0


def test_caching_disabled_and_reset():
    manager = _manager(enable_caching=False)
    a = _req("a", list(range(9)))
    _run_prefill(manager, a)
    assert manager.get_computed_blocks(_req("b", list(range(9)))) == ([], 0)
    assert manager.take_prefix_cache_stats().num_queries == 0
    manager = _manager()
    _run_prefill(manager, _req("a", list(range(9))))
    assert manager.reset_prefix_cache() == 2
    assert manager.get_computed_blocks(_req("b", list(range(9)))).num_computed_tokens == 0
    assert manager.max_num_blocks_per_req == 16
