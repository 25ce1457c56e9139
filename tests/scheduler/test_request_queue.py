"""RequestQueue: (priority, arrival, seq) order, removal, re-adding."""

import pytest

from kiln.sampling_params import SamplingParams
from kiln.scheduler.queue import RequestQueue
from kiln.scheduler.request import Request


def _req(request_id: str) -> Request:
    return Request(request_id, [1, 2], SamplingParams())


def test_order_priority_then_arrival_then_seq():
    queue = RequestQueue()
    reqs = {name: _req(name) for name in "abcde"}
    queue.add(reqs["a"], (0, 2.0, 0))
    queue.add(reqs["b"], (0, 1.0, 1))
    queue.add(reqs["c"], (-1, 9.0, 2))
    queue.add(reqs["d"], (0, 1.0, 3))
    queue.add(reqs["e"], (5, 0.0, 4))
    assert [r.request_id for r in queue] == ["c", "b", "d", "a", "e"]
    assert queue.peek() is reqs["c"] and len(queue) == 5
    assert queue.remove(reqs["b"]) and not queue.remove(reqs["b"])
    assert reqs["b"] not in queue and reqs["d"] in queue
    assert [queue.pop().request_id for _ in range(4)] == ["c", "d", "a", "e"]
    assert not queue
    with pytest.raises(IndexError):
        queue.peek()
    with pytest.raises(IndexError):
        queue.pop()


def test_readd_after_pop_and_duplicate():
    queue = RequestQueue()
    a, b = _req("a"), _req("b")
    queue.add(a, (0, 0.0, 0))
    queue.add(b, (0, 1.0, 1))
    with pytest.raises(ValueError, match="already waiting"):
        queue.add(a, (0, 0.0, 0))
    assert queue.pop() is a
    queue.add(a, (0, 0.0, 0))  # Preempted: back ahead of later arrivals.
    assert queue.peek() is a
    # A removed entry with a reused id must not hide a new request of that id.
    queue.remove(a)
    a2 = _req("a")
    queue.add(a2, (0, 5.0, 2))
    assert [r for r in queue] == [b, a2]
    assert queue.pop() is b and queue.pop() is a2
