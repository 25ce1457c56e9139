"""The scheduler's side of a KV connector (``kiln.kv_transfer``): what the scheduler asks it and
what it does with the worker side's report.

- Admission: after the local prefix cache, how many more of a waiting request's tokens the
  connector supplies (none for a request recomputed after a failed load), then the request's
  block table once allocated. A load the connector makes asynchronously parks the request in
  ``WAITING_FOR_REMOTE_KVS`` (``loading``, its blocks held) until the worker reports it in
  ``finished_recving``: then it is ready to run from the loaded position, or, when its blocks
  failed to load, recomputed from its local hit or failed, as the policy says.
- Each step: the connector's metadata for the workers.
- A finished request: its blocks are freed now, or held until the worker reports its save done
  (``has_held_blocks``: the engine keeps stepping meanwhile, so the report comes).
- The report after a step: blocks of finished saves freed, counters kept, and the running
  requests holding a block whose load failed handed back (the blocks from the first failed one
  leave the prefix cache) for the scheduler to recompute or fail, as
  ``kv_transfer.kv_load_failure_policy`` says.

Without a connector the scheduler holds this over the null ``NoConnector``: every question gets
"nothing", so the scheduler never asks whether a connector is there.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kiln.config import KilnConfig
from kiln.kv_transfer import KVConnectorRole, create_connector
from kiln.messages import KVConnectorOutput, SchedulerOutput
from kiln.scheduler.kv_cache.manager import KVCacheManager
from kiln.scheduler.request import Request, RequestStatus


class KVTransfers:
    """A KV connector's scheduler side and the state the scheduler keeps about it.

    Args:
        config: reads ``kv_transfer`` and ``cache.block_size``.
        kv_cache_manager: the scheduler's (blocks are freed and uncached through it).
    """

    def __init__(self, config: KilnConfig, kv_cache_manager: KVCacheManager) -> None:
        self.connector = create_connector(config, KVConnectorRole.SCHEDULER)
        self.kv_cache_manager = kv_cache_manager
        self.block_size = config.cache.block_size
        self.fail_on_load_error = config.kv_transfer.kv_load_failure_policy == "fail"
        """``kv_load_failure_policy`` "fail": a request whose load failed is finished."""
        self._sending: dict[str, Request] = {}
        """Finished requests whose blocks the connector holds until their save is done."""
        self._load_failed: set[str] = set()
        """Requests recomputed after a failed load: the connector is not asked for them."""
        self.loading: dict[str, tuple[Request, int]] = {}
        """Requests in ``WAITING_FOR_REMOTE_KVS``: each with its local prefix hit in tokens."""
        self.loaded: list[Request] = []
        """Requests whose asynchronous load finished (still ``WAITING_FOR_REMOTE_KVS``, their
        blocks held): the scheduler starts them before the waiting queue, in this order."""
        self._stats: dict[str, float] = {}

    def num_external_tokens(self, request: Request, num_hit_tokens: int) -> tuple[int, bool]:
        """Tokens the connector supplies past the local hit of ``num_hit_tokens``, and whether
        it loads them asynchronously (never for no tokens)."""
        if request.request_id in self._load_failed:
            return 0, False
        connector = self.connector
        num_tokens, load_async = connector.get_num_new_matched_tokens(request, num_hit_tokens)
        return num_tokens, load_async and num_tokens > 0

    def start_loading(self, request: Request, num_hit_tokens: int, num_external: int) -> None:
        """``request``, admitted with an asynchronous load of ``num_external`` tokens past its
        local hit of ``num_hit_tokens``, waits for it in ``WAITING_FOR_REMOTE_KVS`` (counted
        as computed: its next allocation starts after them)."""
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        request.num_computed_tokens = num_hit_tokens + num_external
        self.loading[request.request_id] = (request, num_hit_tokens)

    @property
    def num_waiting(self) -> int:
        """Requests waiting for their KV: loading, or loaded and not started yet."""
        return len(self.loading) + len(self.loaded)

    def has_held_blocks(self) -> bool:
        """Whether finished requests' blocks wait for the worker's report of their save."""
        return bool(self._sending)

    def admitted(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """``request`` starts with ``block_ids`` (its whole table), ``num_external_tokens`` of
        them the connector's to fill."""
        self.connector.update_state_after_alloc(request, block_ids, num_external_tokens)
        if num_external_tokens:
            self._count("hit_tokens", num_external_tokens)

    def metadata(self, scheduler_output: SchedulerOutput) -> Any:
        """The step's work for the workers (``SchedulerOutput.kv_connector_metadata``)."""
        return self.connector.build_connector_meta(scheduler_output)

    def release(self, request: Request) -> dict[str, Any] | None:
        """A finished request (a loading or loaded one included): free its blocks, or hold them
        until its save is done. Returns the connector's ``kv_transfer_params`` for the client."""
        request_id = request.request_id
        self._load_failed.discard(request_id)
        if self.loading.pop(request_id, None) is None and request in self.loaded:
            self.loaded.remove(request)
        block_ids = self.kv_cache_manager.get_block_ids(request_id)
        hold, params = self.connector.request_finished(request, block_ids)
        if hold:
            self._sending[request_id] = request
        else:
            self.kv_cache_manager.free(request)
        return params

    def apply(self, report: KVConnectorOutput, running: Iterable[Request]) -> list[Request]:
        """The worker side's report of a step. Requests whose asynchronous load finished and
        holds no failed block join ``loaded`` (ready to run from their ``num_computed_tokens``).

        Returns:
            The requests holding a block whose load failed: ``running`` ones and loading ones
            (each counted in ``failed_loads``, marked not to ask the connector again, its blocks
            from the first failed one out of the prefix cache; a loading one back at its local
            hit).
        """
        for request_id in report.finished_sending:
            request = self._sending.pop(request_id, None)
            if request is not None:
                self.kv_cache_manager.free(request)
        for name, value in report.stats.items():
            self._count(name, value)
        invalid = report.invalid_block_ids
        failed = [r for r in running if invalid and self._failed_load(r, invalid)]
        for request_id in report.finished_recving:
            request, _ = self.loading.pop(request_id, (None, 0))
            if request is None:
                continue  # finished (aborted) while it loaded
            if invalid and self._failed_load(request, invalid):
                failed.append(request)
                continue
            self.loaded.append(request)
        return failed

    def _failed_load(self, request: Request, invalid: set[int]) -> bool:
        """Whether ``request`` holds a block of ``invalid``; if so it is counted, marked and
        uncached from the first such block."""
        block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
        bad = [i for i, block_id in enumerate(block_ids) if block_id in invalid]
        if not bad:
            return False
        self.kv_cache_manager.uncache(request, bad[0] * self.block_size)
        self._count("failed_loads", 1)
        self._load_failed.add(request.request_id)
        return True

    def take_stats(self) -> dict[str, float]:
        """The counters since the last call (``kiln.kv_transfer.STAT_NAMES``)."""
        stats, self._stats = self._stats, {}
        return stats

    def _count(self, name: str, value: float) -> None:
        self._stats[name] = self._stats.get(name, 0) + value


__all__ = ["KVTransfers"]
