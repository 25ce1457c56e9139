"""Messages between the front end (LLM, AsyncLLM), the engine core, the scheduler and the worker.

The front end <-> engine core messages are msgspec structs so that they cross a ZMQ socket as
msgpack cheaply; the same objects are used in-process. They carry token ids, never text:
tokenization happens in the front end. The scheduler <-> model runner messages
(``SchedulerOutput``, ``ModelRunnerOutput``) are plain dataclasses (no tensors, no callables) so
the scheduler can be tested with hand-made runner outputs. New (or resumed) requests carry their
full data; requests already running carry only what changed (new blocks, computed-token counts).

This module sits at the bottom of Kiln's layers (``docs/architecture.md``), so the scheduler
(``kiln.scheduler``), the worker and the front end (``kiln.engine``) all import it without going up.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from kiln.lora.request import LoRARequest
from kiln.pooling_params import PoolingParams
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
    lora_request: LoRARequest | None = None
    """The adapter the request runs with (None: the base model)."""
    pooling_params: PoolingParams | None = None
    """A pooling request (``--runner pooling``): prefilled, never decoded; it finishes after its
    last prompt token with its pooled vector (``EngineCoreOutput.pooled``)."""


class LogprobsLists(msgspec.Struct, array_like=True, gc=False):
    """Logprobs of ``N`` positions: column 0 is the sampled (or prompt) token, then the top-k."""

    logprob_token_ids: list[list[int]]
    """[N][k+1]"""
    logprobs: list[list[float]]
    """[N][k+1]"""
    sampled_token_ranks: list[int]
    """[N] rank of column 0's token in the distribution (1 = most likely)."""

    def slice(self, start: int, stop: int) -> LogprobsLists:
        """Positions ``start .. stop - 1``."""
        return LogprobsLists(
            self.logprob_token_ids[start:stop],
            self.logprobs[start:stop],
            self.sampled_token_ranks[start:stop],
        )

    @classmethod
    def concat(cls, parts: list[LogprobsLists]) -> LogprobsLists:
        """The positions of ``parts``, one after the other."""
        return cls(
            [row for part in parts for row in part.logprob_token_ids],
            [row for part in parts for row in part.logprobs],
            [rank for part in parts for rank in part.sampled_token_ranks],
        )


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    """Logprobs of prompt tokens 1..P-1 (token 0 has none), sent once with the first output."""
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    scheduled_time: float = 0.0
    """``time.time()`` when the request was first scheduled, sent once with its first tokens
    (0 otherwise): where its queue time ends and its prefill begins."""
    pooled: bytes | None = None
    """A pooling request's vector, float32 little-endian, with its (finishing) output."""
    kv_transfer_params: dict[str, Any] | None = None
    """What the KV connector returns to the client with a finished request (vLLM's
    ``kv_transfer_params``: where a decode instance pulls its KV from)."""

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
    spec_num_drafts: int = 0
    """Speculative decoding, since the last stats: request-steps that verified drafts..."""
    spec_num_draft_tokens: int = 0
    """...the draft tokens they verified..."""
    spec_num_accepted_tokens: int = 0
    """...and how many of those were accepted."""
    kv_connector_stats: dict[str, float] = {}
    """The KV connector's counters since the last stats (``kiln.kv_transfer.STAT_NAMES``)."""


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    error: str | None = None
    """Set when the engine core failed; the front end raises EngineDeadError with it."""
    engine_index: int = 0
    """The engine core that sent these (``parallel.data_parallel_rank``)."""


class EngineDeadError(RuntimeError):
    """The engine core process died or failed; no request can complete."""


class RequestFailedError(ValueError):
    """The engine failed one request for a reason of its own (finish reason "error": its LoRA
    adapter would not load, its grammar did not compile); the others go on. The message is for
    the request's client (the API answers it as a 400)."""


KV_LOAD_FAILED = "its KV-cache blocks failed to load (kv_load_failure_policy 'fail')"
"""The ``stop_reason`` of a request failed because its KV connector's load failed."""


class KVLoadFailedError(RequestFailedError):
    """The request's KV blocks failed to load and ``kv_load_failure_policy`` is "fail": the
    fault is the server's, not the request's (the API answers a 503; a retry may succeed)."""


@dataclass
class NewRequestData:
    """A request the runner has no state for: new, or resumed after preemption."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    """Tokens already generated (non-empty only when resumed after preemption)."""
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    """Tokens whose KV is already in the blocks (prefix-cache hits)."""
    lora_request: LoRARequest | None = None
    """The adapter the request runs with (None: the base model)."""
    pooling_params: PoolingParams | None = None
    """A pooling request's parameters (None: a generation request)."""


@dataclass
class CachedRequestData:
    """Running requests the runner already holds: only what changed, in parallel lists."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    """Blocks appended to each request's block table this step (often empty)."""
    num_computed_tokens: list[int] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)
    """Pipeline parallelism only (empty otherwise): each request's tokens this step computes.
    Only the last stage samples, so the earlier ones learn the sampled tokens from here."""


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    """request id -> tokens to compute this step."""
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]
    """Requests finished or preempted since the last step: the runner drops their state."""
    structured_output_request_ids: list[str] = field(default_factory=list)
    """Structured-output requests that sample this step, in the rows' order of
    ``grammar_bitmask``: one row each, or ``1 + k`` consecutive rows for a request verifying
    ``k`` drafts (``scheduled_spec_decode_tokens``), one per logits position."""
    grammar_bitmask: np.ndarray | None = None
    """[sum over structured_output_request_ids of 1 + num drafts, ceil(V / 32)] int32: bit
    ``t % 32`` of word ``t // 32`` set when token ``t`` may be sampled there (the runner masks
    the rest). A request's row ``j`` is what its grammar allows after its tokens and its first
    ``j`` drafts."""
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    """Speculative decoding: request id -> the draft tokens it verifies this step (the last
    ``len(drafts)`` of its scheduled tokens); requests without drafts are absent."""
    kv_connector_metadata: Any = None
    """The KV connector's work for the workers this step (its own picklable object, from its
    ``build_connector_meta``); None without a connector."""


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]
    """Per request in ``req_ids`` order: the sampled token, or [] for a partial prefill chunk;
    with drafts, its accepted drafts and then one more token."""
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    """Per request that asked for logprobs and sampled this step: the logprobs of its sampled
    tokens (one row each). Complete: the scheduler routes them as they are (cut where a stop
    cuts the tokens)."""
    prompt_logprobs_dict: dict[str, LogprobsLists] = field(default_factory=dict)
    """Per request that asked for prompt logprobs and whose prefill finished this step (the step
    that samples its first token): all ``P - 1`` of them, never in chunks."""
    spec_token_ids: list[list[int]] = field(default_factory=list)
    """Speculative decoding: per request in ``req_ids`` order, the drafts proposed for its next
    step ([] for none); empty when the runner does not speculate."""
    failed_requests: dict[str, str] = field(default_factory=dict)
    """Requests that failed in this step for a reason of their own (their LoRA adapter would
    not load), with the reason for their client (no path, no traceback). Their tokens are
    meaningless: the scheduler finishes them with finish reason "error"."""
    kv_connector_output: KVConnectorOutput | None = None
    """The KV connector's report of the step; None without a connector."""
    pooler_output: dict[str, bytes] = field(default_factory=dict)
    """Per pooling request whose prompt finished this step: its pooled vector (float32
    little-endian bytes); the scheduler finishes it with this."""


@dataclass
class KVConnectorOutput:
    """What the worker side of a KV connector reports after a step (``kiln.kv_transfer``)."""

    finished_sending: set[str] = field(default_factory=set)
    """Requests whose asynchronous save finished: their blocks, held past their end, are
    freed."""
    finished_recving: set[str] = field(default_factory=set)
    """Requests whose asynchronous load finished: they may be scheduled."""
    invalid_block_ids: set[int] = field(default_factory=set)
    """Blocks whose load failed: what they hold is not the KV their hashes say."""
    stats: dict[str, float] = field(default_factory=dict)
    """Counters since the last report (``kiln.kv_transfer.base.STAT_NAMES``)."""


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
