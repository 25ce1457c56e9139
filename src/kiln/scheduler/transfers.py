"""The scheduler's side of a KV connector (``kiln.kv_transfer``): what the scheduler asks it and
what it does with the worker side's report.

- Admission: after the local prefix cache, how many more of a waiting request's tokens the
  connector supplies (none for a request recomputed after a failed load), then the request's
  block table once allocated.
- Each step: the connector's metadata for the workers.
- A finished request: its blocks are freed now, or held until the worker reports its save done.
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
from kiln.scheduler.request import Request


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
        self._stats: dict[str, float] = {}

    def num_external_tokens(self, request: Request, num_hit_tokens: int) -> int:
        """Tokens the connector supplies past the local hit of ``num_hit_tokens``.

        Raises:
            NotImplementedError: the connector asked for an asynchronous load.
        """
        if request.request_id in self._load_failed:
            return 0
        connector = self.connector
        num_tokens, load_async = connector.get_num_new_matched_tokens(request, num_hit_tokens)
        if load_async:
            raise NotImplementedError(
                f"{type(connector).__name__} asked for an asynchronous load; Kiln loads within "
                "the step (finish them in start_load_kv)"
            )
        return num_tokens

    def admitted(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """``request`` starts with ``block_ids`` (its whole table), ``num_external_tokens`` of
        them the connector's to fill."""
        self.connector.update_state_after_alloc(request, block_ids, num_external_tokens)
        if num_external_tokens:
            self._count("hit_tokens", num_external_tokens)

    def metadata(self, scheduler_output: SchedulerOutput) -> Any:
        """The step's work for the workers (``SchedulerOutput.kv_connector_metadata``)."""
        return self.connector.build_connector_meta(scheduler_output)

    def release(self, request: Request) -> None:
        """A finished request: free its blocks, or hold them until its save is done."""
        request_id = request.request_id
        self._load_failed.discard(request_id)
        block_ids = self.kv_cache_manager.get_block_ids(request_id)
        hold, _ = self.connector.request_finished(request, block_ids)
        if hold:
            self._sending[request_id] = request
        else:
            self.kv_cache_manager.free(request)

    def apply(self, report: KVConnectorOutput, running: Iterable[Request]) -> list[Request]:
        """The worker side's report of a step. Returns the ``running`` requests that hold a
        block whose load failed (each counted in ``failed_loads``, marked not to ask the
        connector again, its blocks from the first failed one out of the prefix cache)."""
        for request_id in report.finished_sending:
            request = self._sending.pop(request_id, None)
            if request is not None:
                self.kv_cache_manager.free(request)
        for name, value in report.stats.items():
            self._count(name, value)
        failed = []
        invalid = report.invalid_block_ids
        for request in running if invalid else ():
            block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
            bad = [i for i, block_id in enumerate(block_ids) if block_id in invalid]
            if bad:
                self.kv_cache_manager.uncache(request, bad[0] * self.block_size)
                self._count("failed_loads", 1)
                self._load_failed.add(request.request_id)
                failed.append(request)
        return failed

    def take_stats(self) -> dict[str, float]:
        """The counters since the last call (``kiln.kv_transfer.STAT_NAMES``)."""
        stats, self._stats = self._stats, {}
        return stats

    def _count(self, name: str, value: float) -> None:
        self._stats[name] = self._stats.get(name, 0) + value


__all__ = ["KVTransfers"]
