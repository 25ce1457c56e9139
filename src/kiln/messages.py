"""Messages between the front end (LLM, AsyncLLM), the engine core and the worker, in any process.

They are msgspec structs so that they cross a ZMQ socket as msgpack cheaply; the same objects are
used in-process. They carry token ids, never text: tokenization happens in the front end. This
module sits at the bottom of Kiln's layers (``docs/architecture.md``), so the engine core
(``kiln.core``), the worker and the front end (``kiln.engine``) all import it without going up.
"""

from __future__ import annotations

import enum

import msgspec

from kiln.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    """Why a request finished; ``str()`` gives the OpenAI ``finish_reason``."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3

    def __str__(self) -> str:
        return self.name.lower()


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    priority: int = 0


class LogprobsLists(msgspec.Struct, array_like=True, gc=False):
    """Logprobs of ``N`` positions: column 0 is the sampled (or prompt) token, then the top-k."""

    logprob_token_ids: list[list[int]]
    """[N][k+1]"""
    logprobs: list[list[float]]
    """[N][k+1]"""
    sampled_token_ranks: list[int]
    """[N] rank of column 0's token in the distribution (1 = most likely)."""


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    """Logprobs of prompt tokens 1..P-1 (token 0 has none), sent once with the first output."""
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, gc=False):
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    """Fraction of KV-cache blocks in use, 0..1."""
    prefix_cache_queries: int = 0
    """Prompt tokens looked up in the prefix cache since the last stats."""
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    """Preemptions since the last stats."""


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    error: str | None = None
    """Set when the engine core failed; the front end raises EngineDeadError with it."""


class EngineDeadError(RuntimeError):
    """The engine core process died or failed; no request can complete."""
