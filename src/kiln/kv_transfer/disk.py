"""The offloading connector's disk tier: one file per block and tensor-parallel rank.

A file is a 32-byte header (magic, the block's prefix hash, the rank, the payload's length and
its CRC-32) and the payload, every layer's slice of the block in cache order. A file is written
under a temporary name and renamed into place, so a reader sees a whole file or none; a file that
is short, foreign or corrupt anyway (a crash mid-write on a file system without atomic rename, a
disk error, another program) fails its header or checksum and is a miss: the load is reported
failed and the blocks are recomputed, never used.

The tier does not outlive the engine: the scheduler side clears the directory's block files when
it starts (its index of what is on disk starts empty).
"""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path

import torch

MAGIC = b"KILNKV01"
HEADER = struct.Struct("<8sQIIQ")
"""magic, prefix hash (as an unsigned 64-bit number), rank, CRC-32 of the payload, its length."""
SUFFIX = ".kvblock"


def _unsigned(block_hash: int) -> int:
    """A prefix hash (a Python ``hash``, possibly negative) as an unsigned 64-bit number."""
    return block_hash & 0xFFFF_FFFF_FFFF_FFFF


def block_path(directory: Path, block_hash: int, rank: int) -> Path:
    """Where ``rank``'s slice of the block with ``block_hash`` lives."""
    return directory / f"{_unsigned(block_hash):016x}.r{rank}{SUFFIX}"


def clear(directory: Path) -> None:
    """Make ``directory`` and remove the block files (and torn temporaries) in it."""
    directory.mkdir(parents=True, exist_ok=True)
    for path in directory.iterdir():
        if path.name.endswith(SUFFIX) or f"{SUFFIX}.tmp" in path.name:
            path.unlink(missing_ok=True)


def write_block(path: Path, block_hash: int, rank: int, parts: list[torch.Tensor]) -> int:
    """Write ``parts`` (each layer's slice of one block) to ``path`` whole or not at all;
    returns the bytes written."""
    payload = b"".join(part.contiguous().view(torch.uint8).numpy().tobytes() for part in parts)
    header = HEADER.pack(MAGIC, _unsigned(block_hash), rank, zlib.crc32(payload), len(payload))
    temporary = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with open(temporary, "wb") as file:
        file.write(header)
        file.write(payload)
    os.replace(temporary, path)
    return HEADER.size + len(payload)


def read_block(path: Path, block_hash: int, rank: int, num_bytes: int) -> memoryview | None:
    """The payload of ``path`` if it is the whole block ``block_hash`` of ``rank`` with
    ``num_bytes`` bytes of payload and its checksum holds; None for anything else."""
    try:
        data = bytearray(path.read_bytes())  # writable: torch.frombuffer shares it
    except OSError:
        return None
    if len(data) != HEADER.size + num_bytes:
        return None
    magic, stored_hash, stored_rank, crc, length = HEADER.unpack_from(data)
    payload = memoryview(data)[HEADER.size :]
    expected = (MAGIC, _unsigned(block_hash), rank, num_bytes)
    if (magic, stored_hash, stored_rank, length) != expected or zlib.crc32(payload) != crc:
        return None
    return payload


__all__ = ["HEADER", "block_path", "clear", "read_block", "write_block"]
