"""The KV connector contract: what moves KV-cache blocks in and out of an engine, in vLLM's shape.

One class serves two roles, each instance built for one (``KVConnectorRole``):

- **Scheduler side** (the engine-core process; token ids and block ids only). For a waiting
  request, after the local prefix cache: ``get_num_new_matched_tokens`` says how many more of
  its tokens the connector can supply, and whether it loads them asynchronously. Once blocks
  are allocated, ``update_state_after_alloc`` gets the request's whole block table and the
  external tokens' count. At the end of every ``schedule()``, ``build_connector_meta`` turns
  what the connector decided into the step's metadata (``SchedulerOutput.
  kv_connector_metadata``), which the workers receive. When a request finishes,
  ``request_finished`` may keep its blocks held (``True``: an asynchronous save runs; they are
  freed once the worker reports it in ``finished_sending``) and returns the
  ``kv_transfer_params`` a client gets.
- **Worker side** (each worker; tensors). ``register_kv_caches`` hands over the layers' caches
  and the index of their block dimension (a backend's layout is its own). Each step:
  ``bind_connector_metadata``, ``start_load_kv`` before the forward, ``wait_for_layer_load`` and
  ``save_kv_layer`` around each attention layer (``uses_layer_hooks``), ``wait_for_save`` after
  the forward, then ``get_finished`` and ``get_block_ids_with_load_errors`` for the step's
  ``KVConnectorOutput``, and ``clear_connector_metadata``.

Ordering the core guarantees: a step's loads run before its forward reads the cache and its
saves after the forward wrote it; blocks freed by the scheduler keep their contents until a
later step's forward writes them, so a save in the step after a block was freed still reads it.

A block that fails to load is reported by id; the scheduler then recomputes the request from
the first such block (``kv_load_failure_policy`` "recompute") or fails it ("fail"). A connector
never makes a request produce tokens from wrong KV.

This module knows nothing about a particular transport or tier.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from kiln.config import KilnConfig
    from kiln.messages import SchedulerOutput
    from kiln.scheduler.request import Request

STAT_NAMES = (
    "hit_tokens",
    "loaded_blocks",
    "saved_blocks",
    "loaded_bytes",
    "saved_bytes",
    "spilled_blocks",
    "spilled_bytes",
    "load_seconds",
    "save_seconds",
    "failed_loads",
)
"""Counters of a connector (each since its last report): ``hit_tokens``, the prompt tokens it
supplied (counted by the scheduler); the others from its worker side's ``take_stats``.
``/metrics`` exports them as ``vllm:kv_connector_<name>_total``."""


class KVConnectorRole(enum.Enum):
    SCHEDULER = "scheduler"
    WORKER = "worker"


class KVConnectorBase:
    """A KV connector; subclasses override the hooks of the role they serve.

    Args:
        config: the engine's config (``kv_transfer`` holds the connector's options).
        role: the side this instance serves.

    Every hook here does nothing (or supplies nothing), so a connector that only saves, or
    only loads, overrides only what it uses.
    """

    uses_layer_hooks = False
    """Whether ``wait_for_layer_load`` / ``save_kv_layer`` do anything: without them the
    attention layers skip the calls."""

    def __init__(self, config: KilnConfig, role: KVConnectorRole) -> None:
        self.config = config
        self.role = role
        self._metadata: Any = None

    # -- scheduler side ------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens of ``request`` after its first ``num_computed_tokens`` (the local prefix hit,
        whole blocks) that the connector can supply, in whole blocks, never its last token;
        and whether it loads them asynchronously (the request then waits in
        ``WAITING_FOR_REMOTE_KVS`` while others run). No side effects."""
        return 0, False

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """``request`` was admitted with ``block_ids`` (its whole block table) of which the
        ``num_external_tokens`` after its local hit are the connector's to fill."""

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        """The step's work for the workers (a picklable object); resets what it hands over."""
        return None

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``request`` finished holding ``block_ids``. Returns whether its blocks stay held
        until the worker reports it in ``finished_sending``, and its ``kv_transfer_params``."""
        return False, None

    # -- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], block_dim: int) -> None:
        """The layers' caches by layer name; dimension ``block_dim`` of each indexes blocks."""

    def bind_connector_metadata(self, metadata: Any) -> None:
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    def start_load_kv(self) -> None:
        """Start (or, for a synchronous connector, do) the step's loads, before the forward."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until ``layer_name``'s loads are in its cache (``uses_layer_hooks``)."""

    def save_kv_layer(self, layer_name: str, kv_cache: torch.Tensor, attn_metadata: Any) -> None:
        """``layer_name`` wrote the step's keys and values (``uses_layer_hooks``)."""

    def wait_for_save(self) -> None:
        """After the forward: finish (or start) the step's saves."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """``(finished_sending, finished_recving)``: asynchronous transfers done since the last
        call (``finished_req_ids``: requests the scheduler finished meanwhile)."""
        return set(), set()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (and were reported)."""
        return set()

    def take_stats(self) -> dict[str, float]:
        """Counters (``STAT_NAMES``) since the last call."""
        return {}


class NoConnector(KVConnectorBase):
    """The null connector the scheduler and the runner hold without ``kv_transfer.kv_connector``:
    it supplies and saves nothing."""


__all__ = ["STAT_NAMES", "KVConnectorBase", "KVConnectorRole", "NoConnector"]
