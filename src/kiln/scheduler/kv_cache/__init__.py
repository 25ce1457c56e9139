"""The paged KV cache's bookkeeping: block pool, prefix hashing, per-request block tables.

Everything here is plain Python over block ids; the tensors the ids index belong to the model
runner.
"""

from kiln.scheduler.kv_cache.block_pool import NULL_BLOCK_ID, BlockPool, KVCacheBlock
from kiln.scheduler.kv_cache.manager import KVCacheManager, PrefixCacheStats, PrefixMatch
from kiln.scheduler.kv_cache.prefix_hash import hash_block_tokens, update_block_hashes

__all__ = [
    "NULL_BLOCK_ID",
    "BlockPool",
    "KVCacheBlock",
    "KVCacheManager",
    "PrefixCacheStats",
    "PrefixMatch",
    "hash_block_tokens",
    "update_block_hashes",
]
