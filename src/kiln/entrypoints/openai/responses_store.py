"""The in-memory store of ``/v1/responses``: what ``store: true`` keeps, for ``GET
/v1/responses/{id}``, ``previous_response_id`` and ``cancel``.

Contract: entries live in namespaces (one per API key; one for all when the server has no keys),
and an id is invisible outside its namespace (a 404, as an unknown id). The store is bounded:
at most ``max_entries`` entries and ``max_bytes`` bytes (each entry counted as the JSON size of
its response and conversation), the oldest evicted first; an entry older than ``ttl_s`` is gone
(dropped when next seen, and when evicting). An entry larger than ``max_bytes`` alone is not
kept. A response in progress is an entry too, with the ids of its engine requests, so that
``cancel`` can abort it. Time comes from ``clock`` (monotonic seconds), so tests can move it.

What it must not know: HTTP, the engine (``cancel`` hands the engine ids back to the caller).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

DEFAULT_MAX_ENTRIES = 10_000
DEFAULT_MAX_BYTES = 256 * 2**20
DEFAULT_TTL_S = 3600.0


@dataclass
class StoredResponse:
    """One response: its object, and the conversation a follow-up continues (the items it was
    given, previous ones included, then its output items)."""

    response: dict[str, Any]
    conversation: list[dict[str, Any]]
    created: float
    num_bytes: int = 0
    engine_request_ids: list[str] = field(default_factory=list)
    """While in progress: the requests ``cancel`` aborts."""


class ResponseStore:
    """Bounded, expiring, per-namespace storage of responses (see the module doc)."""

    def __init__(
        self,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        max_bytes: int = DEFAULT_MAX_BYTES,
        ttl_s: float = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_entries < 0 or max_bytes < 0 or ttl_s <= 0:
            raise ValueError(
                "responses store bounds: max_entries and max_bytes must be >= 0 and ttl_s > 0, "
                f"got {max_entries}, {max_bytes}, {ttl_s}"
            )
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.clock = clock
        self._entries: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(
        self,
        namespace: str,
        response: dict[str, Any],
        conversation: list[dict[str, Any]],
        engine_request_ids: list[str] | None = None,
    ) -> bool:
        """Keep (or replace) ``response`` under its ``id``; returns whether it was kept (an entry
        over ``max_bytes`` alone is not, and drops any earlier version of itself)."""
        key = (namespace, response["id"])
        self._drop(key)
        num_bytes = len(msgspec.json.encode(response)) + len(msgspec.json.encode(conversation))
        if num_bytes > self.max_bytes or self.max_entries == 0:
            return False
        self._expire()
        while self._entries and (
            len(self._entries) >= self.max_entries or self.num_bytes + num_bytes > self.max_bytes
        ):
            self._drop(next(iter(self._entries)))
        entry = StoredResponse(
            response, conversation, self.clock(), num_bytes, list(engine_request_ids or [])
        )
        self._entries[key] = entry
        self.num_bytes += num_bytes
        return True

    def get(self, namespace: str, response_id: str) -> StoredResponse | None:
        """The entry, unless it is unknown, of another namespace, or expired."""
        key = (namespace, response_id)
        entry = self._entries.get(key)
        if entry is not None and self.clock() - entry.created > self.ttl_s:
            self._drop(key)
            return None
        return entry

    def delete(self, namespace: str, response_id: str) -> bool:
        """Forget the entry; returns whether there was one."""
        if self.get(namespace, response_id) is None:
            return False
        self._drop((namespace, response_id))
        return True

    def _drop(self, key: tuple[str, str]) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.num_bytes -= entry.num_bytes

    def _expire(self) -> None:
        # Insertion order is age order (a replaced entry moves to the end with a new time).
        now = self.clock()
        while self._entries:
            key, entry = next(iter(self._entries.items()))
            if now - entry.created <= self.ttl_s:
                break
            self._drop(key)


__all__ = [
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_ENTRIES",
    "DEFAULT_TTL_S",
    "ResponseStore",
    "StoredResponse",
]
