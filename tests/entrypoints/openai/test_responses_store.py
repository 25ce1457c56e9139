"""``ResponseStore`` on its own (no server): its bounds in count and bytes evict the oldest
entries, its TTL expires them, an entry too large alone is not kept, and namespaces never see
each other's ids. Time is a settable clock; sizes are computed here from the JSON written out."""

from __future__ import annotations

import json

import pytest

from kiln.entrypoints.openai.responses_store import ResponseStore


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _response(response_id: str, text: str = "") -> dict:
    return {"id": response_id, "status": "completed", "output": [{"text": text}]}


def _size(response: dict, conversation: list) -> int:
    compact = {"separators": (",", ":")}
    return len(json.dumps(response, **compact)) + len(json.dumps(conversation, **compact))


def test_count_bound_evicts_the_oldest() -> None:
    store = ResponseStore(max_entries=2, max_bytes=10**6, ttl_s=60)
    for name in ("a", "b", "c"):
        store.put("", _response(name), [])
    assert len(store) == 2
    assert store.get("", "a") is None
    assert store.get("", "b") is not None and store.get("", "c") is not None


def test_byte_bound_evicts_the_oldest_and_counts_json_bytes() -> None:
    one = _response("a", "x" * 100)
    size = _size(one, [{"role": "user"}])
    store = ResponseStore(max_entries=100, max_bytes=2 * size, ttl_s=60)
    store.put("", one, [{"role": "user"}])
    assert store.num_bytes == size
    store.put("", _response("b", "x" * 100), [{"role": "user"}])
    assert store.num_bytes == 2 * size and len(store) == 2
    store.put("", _response("c", "x" * 100), [{"role": "user"}])
    assert store.get("", "a") is None and len(store) == 2 and store.num_bytes == 2 * size


def test_an_entry_over_the_byte_bound_is_not_kept() -> None:
    store = ResponseStore(max_entries=10, max_bytes=200, ttl_s=60)
    store.put("", _response("small"), [])
    assert not store.put("", _response("big", "x" * 500), [])
    assert store.get("", "big") is None and store.get("", "small") is not None


def test_ttl_expires_entries() -> None:
    clock = Clock()
    store = ResponseStore(max_entries=10, max_bytes=10**6, ttl_s=30, clock=clock)
    store.put("", _response("old"), [])
    clock.now += 20
    store.put("", _response("new"), [])
    clock.now += 11  # "old" is 31 s old, "new" 11 s
    assert store.get("", "old") is None
    assert store.get("", "new") is not None
    clock.now += 20
    store.put("", _response("newest"), [])  # a put drops what has expired
    assert len(store) == 1 and store.get("", "newest") is not None


def test_replacing_an_entry_keeps_one_copy() -> None:
    store = ResponseStore(max_entries=10, max_bytes=10**6, ttl_s=60)
    store.put("", {"id": "a", "status": "in_progress", "output": []}, [])
    store.put("", _response("a", "done"), [])
    entry = store.get("", "a")
    assert len(store) == 1 and entry is not None and entry.response["status"] == "completed"
    assert store.num_bytes == _size(_response("a", "done"), [])


def test_namespaces_are_isolated() -> None:
    store = ResponseStore(max_entries=10, max_bytes=10**6, ttl_s=60)
    store.put("key-1", _response("a"), [])
    assert store.get("key-2", "a") is None and store.get("", "a") is None
    assert not store.delete("key-2", "a")
    assert store.delete("key-1", "a") and store.get("key-1", "a") is None


@pytest.mark.parametrize(
    "bounds", [{"max_entries": -1}, {"max_bytes": -1}, {"ttl_s": 0}, {"ttl_s": -5}]
)
def test_bad_bounds_are_refused(bounds: dict) -> None:
    with pytest.raises(ValueError, match="responses store bounds"):
        ResponseStore(**bounds)
