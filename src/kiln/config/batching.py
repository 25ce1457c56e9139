"""``CacheConfig`` (the paged KV cache) and ``SchedulerConfig`` (continuous batching limits)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.config.checks import check

SCHEDULING_POLICIES = ("fcfs", "priority")


def parse_kv_cache_memory(value: float | str | None) -> dict[str, float | None]:
    """``--kv-cache-memory``: a number is GiB, ``"N%"`` a share of free memory.

    Raises:
        ValueError: neither form (the message shows both).
    """
    if value is None:
        return {"kv_cache_memory": None, "kv_cache_memory_fraction": None}
    text = str(value).strip()
    try:
        if text.endswith("%"):
            return {"kv_cache_memory": None, "kv_cache_memory_fraction": float(text[:-1]) / 100}
        return {"kv_cache_memory": float(text), "kv_cache_memory_fraction": None}
    except ValueError:
        raise ValueError(
            f"kv_cache_memory={value!r} is invalid; allowed: a size in GiB like 2 or 0.5, or a "
            "share of free memory like 40%"
        ) from None


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache."""

    block_size: int = 16
    """Token slots per KV-cache block."""
    kv_cache_memory: float | None = field(
        default=None, metadata={"metavar": "GIB|PCT%", "parse": parse_kv_cache_memory}
    )
    """KV-cache size in GiB (2, or 0.25 for 256 MiB); as a flag or keyword also a share of the
    memory free after the model loads ("40%", which sets ``kv_cache_memory_fraction``). Neither
    set: the worker's default, 40% of free memory, at most 4 GiB."""
    kv_cache_memory_fraction: float | None = field(
        default=None, metadata={"set_by": "kv_cache_memory"}
    )
    """KV-cache size as a fraction of the memory free after the model loads, in (0, 1]."""
    enable_prefix_caching: bool = True
    """Share full blocks between requests whose prompts start the same way."""
    bytes_per_block: int = field(default=0, metadata={"internal": True})
    """One block's keys and values over every layer, once the worker has measured it (the
    engine core sets it before it builds the scheduler; 0 before)."""

    def __post_init__(self) -> None:
        check(
            self.block_size in (1, 2, 4, 8, 16, 32, 64, 128, 256),
            "cache.block_size",
            self.block_size,
            "a power of two from 1 to 256",
        )
        check(
            self.kv_cache_memory is None or self.kv_cache_memory > 0,
            "cache.kv_cache_memory",
            self.kv_cache_memory,
            "a size in GiB above 0, or None",
        )
        check(
            self.kv_cache_memory_fraction is None or 0 < self.kv_cache_memory_fraction <= 1,
            "cache.kv_cache_memory_fraction",
            self.kv_cache_memory_fraction,
            "a fraction in (0, 1], or None",
        )
        check(
            self.kv_cache_memory is None or self.kv_cache_memory_fraction is None,
            "cache.kv_cache_memory_fraction",
            self.kv_cache_memory_fraction,
            "None when cache.kv_cache_memory is set (give a size or a fraction, not both)",
        )


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_seqs: int = 64
    """Most requests in one step."""
    max_num_batched_tokens: int = 2048
    """Token budget: the most tokens one step computes."""
    enable_chunked_prefill: bool = True
    """Split a long prompt over several steps instead of waiting for a step with room."""
    max_num_waiting: int | None = None
    """Most requests queued before new ones are refused (HTTP 503); None is unbounded."""
    policy: str = field(
        default="fcfs", metadata={"flag": "scheduling_policy", "choices": SCHEDULING_POLICIES}
    )
    """fcfs: first come, first served, and a request's ``priority`` other than 0 is refused;
    priority: lower ``priority`` values run first (then arrival order), as vLLM's policies."""

    def __post_init__(self) -> None:
        check(
            self.max_num_seqs >= 1, "scheduler.max_num_seqs", self.max_num_seqs, "an integer >= 1"
        )
        check(
            self.max_num_batched_tokens >= 1,
            "scheduler.max_num_batched_tokens",
            self.max_num_batched_tokens,
            "an integer >= 1",
        )
        check(
            self.policy in SCHEDULING_POLICIES,
            "scheduler.policy",
            self.policy,
            " or ".join(SCHEDULING_POLICIES),
        )
        check(
            self.max_num_waiting is None or self.max_num_waiting >= 0,
            "scheduler.max_num_waiting",
            self.max_num_waiting,
            "an integer >= 0 or None",
        )
