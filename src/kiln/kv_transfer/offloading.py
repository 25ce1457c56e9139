"""The offloading connector: a CPU-memory tier under the paged KV cache.

Write-through: each block that becomes full (prompt or output) is copied, after the step that
computed it, into a CPU pool of ``kv_transfer.kv_offloading_size`` GiB (or
``kv_connector_extra_config["cpu_bytes"]`` bytes) unless its prefix hash is there already; the
pool evicts the least recently used block. A waiting request whose prefix goes on past the local
prefix cache into the pool loads those blocks, before the forward of the step that admits it,
instead of computing them. So a prefix that fell out of the paged cache (a long system prompt, a
conversation's earlier turns) costs a copy, not a prefill.

With ``kv_connector_extra_config`` ``{"disk_path": DIR, "disk_bytes": N}`` a block the CPU pool
evicts goes on to a disk tier of at most ``N`` bytes in ``DIR`` (``kiln.kv_transfer.disk``: one
checksummed file per block and rank, least recently used out first); a prefix found there loads
from its files. A file that does not check out is a failed load (``kv_load_failure_policy``).

The scheduler side decides everything, which hash sits in which CPU slot and every step's copies
(``OffloadingMetadata``); the worker side only executes them, loads before the forward and saves
after it, so the two sides agree without a reply. Every worker (TP rank) keeps the same slots
for its own shard of the heads.

Roles: ``kv_producer`` only saves, ``kv_consumer`` only loads. Needs ``cache.
enable_prefix_caching`` (the pool is keyed by prefix hash). With a draft model, only the target's
keys and values are offloaded: a loaded block's draft KV is stale, which costs acceptance, never
correctness.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kiln.kv_transfer import disk
from kiln.kv_transfer.base import KVConnectorBase, KVConnectorRole
from kiln.scheduler.request import Request, RequestStatus

if TYPE_CHECKING:
    from kiln.config import KilnConfig
    from kiln.messages import SchedulerOutput

GIB = 1 << 30


@dataclass
class OffloadingMetadata:
    """One step's copies: ``loads`` before the forward, ``saves`` after it."""

    num_slots: int
    """Blocks the CPU pool holds (the worker allocates it on first use)."""
    loads: list[tuple[int, int]] = field(default_factory=list)
    """``(cpu slot, block id)``: copy the slot into the block."""
    saves: list[tuple[int, int]] = field(default_factory=list)
    """``(block id, cpu slot)``: copy the block into the slot; each slot at most once."""
    disk_loads: list[tuple[int, int]] = field(default_factory=list)
    """``(prefix hash, block id)``: read the hash's file into the block, before the forward."""
    disk_drops: list[int] = field(default_factory=list)
    """Prefix hashes whose files to delete, after the forward and before the spills."""
    spills: list[tuple[str, int, int]] = field(default_factory=list)
    """``("slot", cpu slot, prefix hash)``: write the slot to the hash's file, before the saves
    (which may reuse the slot); ``("block", block id, prefix hash)``: write the block (computed
    this step, its save to the pool overtaken by a later one)."""

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves or self.disk_loads or self.disk_drops or self.spills)


@dataclass
class _Tracked:
    """A running request as the scheduler side follows it."""

    request: Request
    block_ids: list[int]
    num_handled: int
    """Leading blocks already saved, found in the pool, or loaded from it."""


class OffloadingConnector(KVConnectorBase):
    """A CPU tier of whole blocks keyed by prefix hash (see the module docstring).

    Raises:
        ValueError: (scheduler side) no pool size, a pool smaller than one block, or prefix
            caching off; each names its field.
    """

    def __init__(self, config: KilnConfig, role: KVConnectorRole) -> None:
        super().__init__(config, role)
        kv = config.kv_transfer
        self.saves = kv.kv_role != "kv_consumer"
        self.loads = kv.kv_role != "kv_producer"
        path = kv.kv_connector_extra_config.get("disk_path")
        self.disk_path = Path(path) if path else None
        if role is KVConnectorRole.SCHEDULER:
            self._init_scheduler(config)
        else:
            self._caches: list[torch.Tensor] = []
            self._pool: list[torch.Tensor] = []
            self._block_dim = 0
            self._layer_block_bytes: list[int] = []
            self._block_bytes = 0
            self._rank = 0
            self._stats: dict[str, float] = {}
            self._load_errors: set[int] = set()

    # -- scheduler side ------------------------------------------------------------------------

    def _init_scheduler(self, config: KilnConfig) -> None:
        kv = config.kv_transfer
        size = kv.kv_offloading_size * GIB if kv.kv_offloading_size else None
        size = kv.kv_connector_extra_config.get("cpu_bytes", size)
        if not isinstance(size, (int, float)) or size <= 0:
            raise ValueError(
                f"kv_transfer.kv_offloading_size={kv.kv_offloading_size!r} is invalid; allowed: "
                "a CPU tier size in GiB above 0 (--kv-offloading-size 4), or "
                'kv_connector_extra_config {"cpu_bytes": N}'
            )
        if not config.cache.enable_prefix_caching:
            raise ValueError(
                "cache.enable_prefix_caching=False is invalid with the OffloadingConnector; "
                "allowed: True (its CPU tier is keyed by prefix hash)"
            )
        bytes_per_block = config.cache.bytes_per_block
        assert bytes_per_block > 0, "the engine core sets cache.bytes_per_block"
        self.num_slots = int(size // bytes_per_block)
        if self.num_slots < 1:
            raise ValueError(
                f"kv_transfer.kv_offloading_size={size / GIB:g} GiB is invalid; allowed: at "
                f"least one block ({bytes_per_block} bytes)"
            )
        self.block_size = config.cache.block_size
        self.bytes_per_block = bytes_per_block
        self._slot_of: OrderedDict[int, int] = OrderedDict()
        """Prefix hash -> CPU slot, least recently used first."""
        self._free_slots = list(range(self.num_slots - 1, -1, -1))
        self._tracked: dict[str, _Tracked] = {}
        self._local_hits: dict[str, int] = {}
        """Per request asked about: blocks of its local prefix hit (``get_num_new_matched_
        tokens``), for ``update_state_after_alloc``."""
        self._step = OffloadingMetadata(self.num_slots)
        self._init_disk(config)

    def _init_disk(self, config: KilnConfig) -> None:
        extra = config.kv_transfer.kv_connector_extra_config
        self._on_disk: OrderedDict[int, None] = OrderedDict()
        """Prefix hashes with files, least recently used first (spilled before this step)."""
        self._spilling: set[int] = set()
        """Hashes whose spill is in this step's metadata: their files are not there yet."""
        self.num_disk_blocks = 0
        if self.disk_path is None:
            if "disk_bytes" in extra:
                raise ValueError(
                    "kv_transfer.kv_connector_extra_config.disk_path is missing; allowed: the "
                    "disk tier's directory, given with disk_bytes"
                )
            return
        world_size = config.parallel.world_size
        if world_size != 1:
            # Only one rank's report reaches the scheduler: another rank's bad file would go
            # unreported, so its blocks would keep stale KV.
            raise ValueError(
                f"kv_transfer.kv_connector_extra_config.disk_path with {world_size} ranks is "
                "invalid; allowed: a single-rank engine (tensor and pipeline parallel size 1)"
            )
        size = extra.get("disk_bytes")
        per_block = self.bytes_per_block + disk.HEADER.size
        if not isinstance(size, int) or isinstance(size, bool) or size < per_block:
            raise ValueError(
                f"kv_transfer.kv_connector_extra_config.disk_bytes={size!r} is invalid; "
                f"allowed: the disk tier's bound in bytes, at least one block ({per_block})"
            )
        self.num_disk_blocks = size // per_block
        disk.clear(self.disk_path)

    def _found(self, block_hash: int) -> bool:
        """Whether the tiers hold ``block_hash``: in the pool, or on disk with its file there."""
        if block_hash in self._slot_of:
            return True
        if block_hash not in self._on_disk or block_hash in self._spilling:
            return False
        assert self.disk_path is not None
        return disk.block_path(self.disk_path, block_hash, 0).exists()

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        start = num_computed_tokens // self.block_size
        self._local_hits[request.request_id] = start
        if not self.loads:
            return 0, False
        end = min(len(request.block_hashes), (request.num_tokens - 1) // self.block_size)
        num_blocks = 0
        for block_hash in request.block_hashes[start:end]:
            if not self._found(block_hash):
                break
            num_blocks += 1
        return num_blocks * self.block_size, False

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        start = self._local_hits.pop(request.request_id, 0)
        end = start + num_external_tokens // self.block_size
        hashes = request.block_hashes
        # Loads first: the local hits' saves below may evict from the pool, never these.
        for i in range(start, end):
            slot = self._slot_of.get(hashes[i])
            if slot is not None:
                self._slot_of.move_to_end(hashes[i])
                self._step.loads.append((slot, block_ids[i]))
            else:
                self._on_disk.move_to_end(hashes[i])
                self._step.disk_loads.append((hashes[i], block_ids[i]))
        for i in range(start):  # local hits: keep them in the pool, most recently used
            self._save(hashes[i], block_ids[i])
        self._tracked[request.request_id] = _Tracked(request, list(block_ids), end)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OffloadingMetadata | None:
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_block_ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            tracked = self._tracked.get(req_id)
            if tracked is not None:
                tracked.block_ids.extend(new_block_ids)
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            request = tracked.request
            # Drafts are not tokens of the request yet: only blocks full of its own tokens.
            num_full = min(request.num_computed_tokens + num_tokens, request.num_tokens)
            num_full = min(num_full // self.block_size, len(request.block_hashes))
            for i in range(tracked.num_handled, num_full):
                self._save(request.block_hashes[i], tracked.block_ids[i])
            tracked.num_handled = max(tracked.num_handled, num_full)
        step, self._step = self._step, OffloadingMetadata(self.num_slots)
        self._spilling = set()
        return step if step else None

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._local_hits.pop(request.request_id, None)
        tracked = self._tracked.pop(request.request_id, None)
        if tracked is not None and request.status == RequestStatus.FINISHED_ERROR:
            # The failed step's blocks hold no KV to trust: the pool forgets their hashes.
            first = request.num_computed_tokens // self.block_size
            for block_hash in request.block_hashes[first : tracked.num_handled]:
                slot = self._slot_of.pop(block_hash, None)
                if slot is not None:
                    self._free_slots.append(slot)
                    self._step.saves = [s for s in self._step.saves if s[1] != slot]
                if block_hash in self._on_disk:
                    del self._on_disk[block_hash]
                    self._forget_file(block_hash)
        return False, None

    def _save(self, block_hash: int, block_id: int) -> None:
        """Keep ``block_hash`` in the pool: touch it, or copy ``block_id`` into a slot after
        this step's forward (a free one, else the least recently used one's)."""
        if block_hash in self._slot_of:
            self._slot_of.move_to_end(block_hash)
            return
        if not self.saves:
            return
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            evicted, slot = self._slot_of.popitem(last=False)
            pending = [s for s in self._step.saves if s[1] == slot]
            if pending:
                # Saved this step, so not in the slot yet: only the last save is kept, an
                # earlier one goes to disk from its block.
                self._step.saves = [s for s in self._step.saves if s[1] != slot]
                if self.num_disk_blocks:
                    self._spill(evicted, "block", pending[0][0])
            elif self.num_disk_blocks:
                self._spill(evicted, "slot", slot)
        self._slot_of[block_hash] = slot
        self._step.saves.append((block_id, slot))

    def _spill(self, block_hash: int, source: str, index: int) -> None:
        """Keep ``block_hash``, leaving the pool, on disk (evicting the least recently used
        file if the tier is full); its KV is in ``source`` ("slot" or "block") ``index``."""
        step = self._step
        if block_hash in self._on_disk:
            self._on_disk.move_to_end(block_hash)
            return
        if block_hash in step.disk_drops:  # its file is still there: keep it
            step.disk_drops.remove(block_hash)
            self._on_disk[block_hash] = None
            return
        if len(self._on_disk) >= self.num_disk_blocks:
            dropped, _ = self._on_disk.popitem(last=False)
            self._forget_file(dropped)
        self._on_disk[block_hash] = None
        self._spilling.add(block_hash)
        step.spills.append((source, index, block_hash))

    def _forget_file(self, block_hash: int) -> None:
        """``block_hash``, out of the disk index, loses its file: its spill is not written if
        it is this step's, else the file is deleted after the forward."""
        step = self._step
        if block_hash in self._spilling:
            self._spilling.discard(block_hash)
            step.spills = [s for s in step.spills if s[2] != block_hash]
        else:
            step.disk_drops.append(block_hash)

    # -- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], block_dim: int) -> None:
        self._caches = list(kv_caches.values())
        self._block_dim = block_dim
        # One block of each layer, in bytes: a disk file's parts; their sum is what each copied
        # block adds to the stats.
        self._layer_block_bytes = [
            cache.element_size() * cache.numel() // cache.shape[block_dim] for cache in self._caches
        ]
        self._block_bytes = sum(self._layer_block_bytes)
        dist = torch.distributed
        self._rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def start_load_kv(self) -> None:
        metadata: OffloadingMetadata | None = self._metadata
        if metadata is not None and metadata.loads:
            self._transfer("loaded", metadata.num_slots, metadata.loads)
        if metadata is not None and metadata.disk_loads:
            self._read_files(metadata.disk_loads)

    def wait_for_save(self) -> None:
        metadata: OffloadingMetadata | None = self._metadata
        if metadata is not None and (metadata.disk_drops or metadata.spills):
            self._write_files(metadata)
        if metadata is not None and metadata.saves:
            self._transfer("saved", metadata.num_slots, metadata.saves)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_stats(self) -> dict[str, float]:
        stats, self._stats = self._stats, {}
        return stats

    def _ensure_pool(self, num_slots: int) -> list[torch.Tensor]:
        """The CPU pool, a tensor per layer shaped like its cache with ``num_slots`` blocks
        (allocated on first use; pinned where the cache is on an accelerator)."""
        if not self._pool:
            for cache in self._caches:
                shape = list(cache.shape)
                shape[self._block_dim] = num_slots
                pin = cache.device.type != "cpu"
                self._pool.append(torch.empty(shape, dtype=cache.dtype, pin_memory=pin))
        return self._pool

    def _transfer(self, kind: str, num_slots: int, copies: list[tuple[int, int]]) -> None:
        """The step's ``copies`` (``kind`` "loaded": ``(slot, block id)`` pairs from the pool into
        the caches; "saved": ``(block id, slot)`` pairs the other way), layer by layer."""
        start = time.perf_counter()
        pool = self._ensure_pool(num_slots)
        sources, targets = (pool, self._caches) if kind == "loaded" else (self._caches, pool)
        source_index, target_index = zip(*copies, strict=True)
        dim = self._block_dim
        # The pool is on the host and every cache on one device: the index pair is built once.
        src = torch.tensor(source_index, dtype=torch.int64, device=sources[0].device)
        dst = torch.tensor(target_index, dtype=torch.int64, device=targets[0].device)
        for source, target in zip(sources, targets, strict=True):
            target.index_copy_(dim, dst, source.index_select(dim, src).to(target.device))
        self._count(kind, len(copies), start)

    def _read_files(self, loads: list[tuple[int, int]]) -> None:
        """Copy each ``(hash, block id)``'s file into the block; a file that is missing or does
        not check out is a load error (and is deleted)."""
        start = time.perf_counter()
        assert self.disk_path is not None
        rank, dim, loaded = self._rank, self._block_dim, 0
        for block_hash, block_id in loads:
            path = disk.block_path(self.disk_path, block_hash, rank)
            payload = disk.read_block(path, block_hash, rank, self._block_bytes)
            if payload is None:
                path.unlink(missing_ok=True)
                self._load_errors.add(block_id)
                continue
            index = torch.tensor([block_id], dtype=torch.int64, device=self._caches[0].device)
            offset = 0
            for cache, size in zip(self._caches, self._layer_block_bytes, strict=True):
                shape = list(cache.shape)
                shape[dim] = 1
                part = torch.frombuffer(payload, dtype=torch.uint8, count=size, offset=offset)
                offset += size
                block = part.view(cache.dtype).reshape(shape).to(cache.device)
                cache.index_copy_(dim, index, block)
            loaded += 1
        self._count("loaded", loaded, start)

    def _write_files(self, metadata: OffloadingMetadata) -> None:
        """The step's file deletions, then its spills (from the pool or the KV cache)."""
        start = time.perf_counter()
        assert self.disk_path is not None
        rank, dim = self._rank, self._block_dim
        for block_hash in metadata.disk_drops:
            disk.block_path(self.disk_path, block_hash, rank).unlink(missing_ok=True)
        pool = self._ensure_pool(metadata.num_slots)
        for source, index, block_hash in metadata.spills:
            layers = pool if source == "slot" else self._caches
            parts = [layer.narrow(dim, index, 1).cpu() for layer in layers]
            path = disk.block_path(self.disk_path, block_hash, rank)
            disk.write_block(path, block_hash, rank, parts)
        self._count("spilled", len(metadata.spills), start)

    def _count(self, kind: str, num_blocks: int, start: float) -> None:
        """Add a copy of ``num_blocks`` blocks (``kind`` "loaded", "saved" or "spilled") to the
        stats."""
        seconds = "load_seconds" if kind == "loaded" else "save_seconds"
        stats = self._stats
        stats[f"{kind}_blocks"] = stats.get(f"{kind}_blocks", 0) + num_blocks
        stats[f"{kind}_bytes"] = stats.get(f"{kind}_bytes", 0) + num_blocks * self._block_bytes
        stats[seconds] = stats.get(seconds, 0) + time.perf_counter() - start


__all__ = ["OffloadingConnector", "OffloadingMetadata"]
