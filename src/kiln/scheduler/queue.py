"""The waiting queue: requests in scheduling order, lowest ``(priority, arrival_time, seq)`` first.

With every priority equal (the default 0) this is first come, first served. A preempted request is
added back under its original key, which puts it ahead of every request that arrived after it: the
front of the queue under FCFS, and its place by priority otherwise (as vLLM's two policies do).

Contract: ``add`` and ``pop`` are O(log n), ``peek`` and ``remove`` O(1) amortized (removal marks
the entry dead; dead entries are dropped when they reach the top). Knows nothing about blocks or
tokens.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from kiln.scheduler.request import Request

SchedulingKey = tuple[int, float, int]
"""``(priority, arrival_time, seq)``: lower runs first; ``seq`` (order of ``add_request``) breaks
ties so the order is total."""


class RequestQueue:
    """A priority queue of requests with O(1) removal by request id."""

    def __init__(self) -> None:
        # Entries are [key, request, is_alive]; a removed entry stays in the heap, dead.
        self._heap: list[list] = []
        self._entries: dict[str, list] = {}

    def add(self, request: Request, key: SchedulingKey) -> None:
        """Queue ``request`` under ``key``.

        Raises:
            ValueError: the request id is already queued.
        """
        if request.request_id in self._entries:
            raise ValueError(f"request {request.request_id!r} is already waiting")
        entry = [key, request, True]
        self._entries[request.request_id] = entry
        heapq.heappush(self._heap, entry)

    def peek(self) -> Request:
        """The next request, left in the queue.

        Raises:
            IndexError: the queue is empty.
        """
        self._drop_dead()
        return self._heap[0][1]

    def pop(self) -> Request:
        """Remove and return the next request.

        Raises:
            IndexError: the queue is empty.
        """
        self._drop_dead()
        entry = heapq.heappop(self._heap)
        del self._entries[entry[1].request_id]
        return entry[1]

    def remove(self, request: Request) -> bool:
        """Take ``request`` out of the queue; returns False when it was not there."""
        entry = self._entries.get(request.request_id)
        if entry is None or entry[1] is not request:
            return False
        entry[2] = False
        del self._entries[request.request_id]
        return True

    def __contains__(self, request: Request) -> bool:
        entry = self._entries.get(request.request_id)
        return entry is not None and entry[1] is request

    def __len__(self) -> int:
        return len(self._entries)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __iter__(self) -> Iterator[Request]:
        """The queued requests in scheduling order (O(n log n): for tests and debugging)."""
        return (entry[1] for entry in sorted(self._entries.values(), key=lambda e: e[0]))

    def _drop_dead(self) -> None:
        heap = self._heap
        while heap and not heap[0][2]:
            heapq.heappop(heap)
        if not heap:
            raise IndexError("the request queue is empty")
