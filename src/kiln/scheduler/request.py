"""A request inside the engine core: token ids, sampling params, and progress.

The engine core knows nothing about text: a request is token ids in, token ids out. Its progress
is two counts, ``num_computed_tokens`` (tokens whose KV is in the cache) and ``num_tokens`` (prompt
plus output so far); the scheduler hands out the difference as the step's work.
"""

from __future__ import annotations

import enum
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from kiln.lora.request import LoRARequest
from kiln.messages import EngineCoreRequest, FinishReason
from kiln.pooling_params import PoolingParams
from kiln.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_GRAMMAR = enum.auto()
    """Its structured-output grammar is still compiling; not schedulable until it is ready."""
    WAITING_FOR_REMOTE_KVS = enum.auto()
    """A KV connector loads part of its prompt asynchronously: it holds its blocks and is not
    scheduled until the worker reports the load finished (``kiln.scheduler.transfers``)."""
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after this is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    """Never ran: the prompt cannot fit in the KV cache or the context."""
    FINISHED_ERROR = enum.auto()
    """Never ran: its structured-output grammar failed or timed out compiling."""

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def finish_reason(status: RequestStatus) -> FinishReason | None:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_IGNORED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    """Lower runs first (as in vLLM); ties go by arrival."""
    lora_request: LoRARequest | None = None
    """The adapter it runs with (None: the base model); its blocks are hashed apart."""
    pooling_params: PoolingParams | None = None
    """A pooling request: it finishes after its last prompt token, with no output tokens."""

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    """Prompt tokens found in the prefix cache when first scheduled (-1: not scheduled yet)."""
    scheduled_time: float = 0.0
    """``time.time()`` when first scheduled (0: not yet), the clock of ``arrival_time``; the end
    of its queue time in the server's metrics."""
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    block_hashes: list[int] = field(default_factory=list)
    """Chained hashes of the request's full blocks, filled by the KV-cache manager."""
    grammar: Future[Any] | None = None
    """Structured outputs: the compile of the request's grammar (None: unconstrained)."""
    matcher: Any = None
    """Structured outputs: the request's own grammar matcher, advanced by its output tokens;
    made when the grammar is ready and kept through preemption (the output tokens stay)."""
    grammar_wait_start: float = 0.0
    """``time.monotonic()`` when the request started waiting for its grammar."""
    spec_token_ids: list[int] = field(default_factory=list)
    """Speculative decoding: the drafts proposed for its next step (verified when scheduled)."""

    @classmethod
    def from_engine_core_request(cls, request: EngineCoreRequest) -> Request:
        return cls(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            sampling_params=request.sampling_params,
            eos_token_id=request.eos_token_id,
            arrival_time=request.arrival_time,
            priority=request.priority,
            lora_request=request.lora_request,
            pooling_params=request.pooling_params,
        )

    @property
    def kv_transfer_params(self) -> dict[str, Any] | None:
        """What the client asked of the KV connector (vLLM's ``kv_transfer_params``, carried in
        ``sampling_params.extra_args``); None: nothing."""
        extra = self.sampling_params.extra_args
        return None if extra is None else extra.get("kv_transfer_params")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> FinishReason | None:
        return RequestStatus.finish_reason(self.status)

    def check_stop(self, max_model_len: int) -> bool:
        """Whether the last output token ends the request (EOS, a stop token, ``max_tokens`` or
        the context, in the order ``kiln.scheduler.scheduler`` documents); sets the finished
        status (and ``stop_reason``) when it does."""
        params = self.sampling_params
        num_output_tokens = self.num_output_tokens
        # A grammar that accepted its stop token is complete: it wins over min_tokens.
        is_grammar_done = self.matcher is not None and self.matcher.is_terminated()
        if num_output_tokens >= params.min_tokens or is_grammar_done:
            last_token_id = self.output_token_ids[-1]
            if last_token_id == self.eos_token_id and not params.ignore_eos:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if last_token_id in (params.stop_token_ids or ()):  # a list after its __post_init__
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last_token_id
                return True
        if is_grammar_done:
            # Nothing may follow a complete grammar, whatever ignore_eos says (as vLLM).
            self.status = RequestStatus.FINISHED_STOPPED
            return True
        if (params.max_tokens is not None and num_output_tokens >= params.max_tokens) or (
            self.num_tokens >= max_model_len
        ):
            self.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False
