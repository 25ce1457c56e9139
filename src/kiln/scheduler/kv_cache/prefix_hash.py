"""Prefix hashing: one chained hash per full block of a request's tokens.

Contract: the hash of block ``i`` is ``hash((hash of block i-1, tuple(block i's token ids)))``, with
a root hash standing in for block ``-1``; a request that runs with a LoRA adapter starts from a root
of its adapter's own (``request_root_hash``), so two adapters never share a block (their keys and
values differ) while requests of the same adapter do. Chaining makes a block's hash name the whole
prefix that ends with it, so equal hashes mean equal prefixes (up to 64-bit collisions) and one
cached block can serve every request that starts the same way. Only full blocks get a hash: a
partial block's tokens are still changing.

Hashes are computed once per block and appended to ``request.block_hashes`` as tokens arrive, prompt
and output alike, so the cost per step is the number of blocks that became full, never the length of
the request.

NOTE: Python's ``hash`` of a tuple of ints is fast and stable within one process (ints are not
salted), which is enough because the engine core is one process. The root hash is random per cache
(``new_root_hash``), so nobody can craft, offline, a prompt whose block hashes collide with another
user's prefix.

This module knows nothing about block ids, the block pool or the scheduler.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from kiln.scheduler.request import Request


def new_root_hash() -> int:
    """A random 64-bit root: the parent hash of every request's first block."""
    return int.from_bytes(os.urandom(8), "little")


def hash_block_tokens(parent_hash: int, token_ids: Sequence[int]) -> int:
    """The hash of one full block given its parent's hash (or the root hash for block 0)."""
    return hash((parent_hash, tuple(token_ids)))


def request_root_hash(request: Request, root_hash: int) -> int:
    """The parent hash of ``request``'s first block: the cache's root, or for a request with a
    LoRA adapter the root chained with the adapter's id."""
    lora = request.lora_request
    return root_hash if lora is None else hash((root_hash, lora.lora_int_id))


def get_token_ids(request: Request, start: int, end: int) -> list[int]:
    """``request``'s token ids in ``[start, end)`` over prompt + output, without concatenating
    the whole sequence."""
    prompt = request.prompt_token_ids
    num_prompt_tokens = len(prompt)
    if end <= num_prompt_tokens:
        return prompt[start:end]
    output = request.output_token_ids
    if start >= num_prompt_tokens:
        return output[start - num_prompt_tokens : end - num_prompt_tokens]
    return prompt[start:] + output[: end - num_prompt_tokens]


def update_block_hashes(
    request: Request, block_size: int, root_hash: int, num_tokens: int | None = None
) -> list[int]:
    """Extend ``request.block_hashes`` to cover every full block of its first ``num_tokens``
    tokens (default: all of them).

    Returns:
        ``request.block_hashes`` (the same list).

    Side effects: appends to ``request.block_hashes``; hashes already there are not recomputed.
    """
    if num_tokens is None:
        num_tokens = request.num_tokens
    block_hashes = request.block_hashes
    num_full_blocks = num_tokens // block_size
    parent_hash = block_hashes[-1] if block_hashes else request_root_hash(request, root_hash)
    for i in range(len(block_hashes), num_full_blocks):
        token_ids = get_token_ids(request, i * block_size, (i + 1) * block_size)
        parent_hash = hash_block_tokens(parent_hash, token_ids)
        block_hashes.append(parent_hash)
    return block_hashes
