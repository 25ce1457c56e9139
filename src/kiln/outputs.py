"""What the engine returns to its users: ``RequestOutput`` and ``CompletionOutput``, as in vLLM.

Contract: plain dataclasses with vLLM's field names and meanings, so code written against vLLM's
``LLM.generate`` / ``AsyncLLM.generate`` reads them unchanged. ``CompletionOutput.finish_reason`` is
the OpenAI string (``"stop"``, ``"length"``, ``"abort"``) or None while running; per-position
logprobs are dicts ``token_id -> Logprob``; ``prompt_logprobs`` starts with None (the first prompt
token has no logprob). Timestamps in ``RequestMetrics`` are wall-clock seconds (``time.time()``).

What it must not know: how the outputs were produced (engine, scheduler, tokenizer); the output
processor fills them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass
class Logprob:
    """The log probability of one token at one position."""

    logprob: float
    rank: int | None = None
    """1 = the most likely token at this position."""
    decoded_token: str | None = None
    """The token's text on its own (None when the request does not detokenize)."""


PositionLogprobs = dict[int, Logprob]
"""Token id -> Logprob at one position: the sampled (or prompt) token first, then the top-k."""

SampleLogprobs = list[PositionLogprobs]
PromptLogprobs = list[PositionLogprobs | None]


@dataclass
class CompletionOutput:
    """One completion of a prompt (one of the ``n``).

    With ``RequestOutputKind.DELTA`` the text, token ids and logprobs hold only what is new since
    the request's previous output; otherwise everything so far.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    """Sum of the sampled tokens' logprobs; None unless logprobs were requested."""
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended the completion; None for EOS or length."""

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timings of one request, for TTFT, inter-token latency and end-to-end latency."""

    arrival_time: float
    scheduled_time: float | None = None
    """When the engine core first scheduled it (sent with its first tokens)."""
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time

    @property
    def mean_inter_token_latency(self) -> float | None:
        if self.first_token_time is None or self.last_token_time is None:
            return None
        if self.num_generation_tokens < 2:
            return None
        decode_time = self.last_token_time - self.first_token_time
        return decode_time / (self.num_generation_tokens - 1)


@dataclass
class RequestOutput:
    """The state of one request (all its ``n`` completions) after a step of the engine."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache."""
    metrics: RequestMetrics | None = None
    pooled: bytes | None = None
    """A pooling request's vector (float32 little-endian bytes); None for generation. The
    offline ``LLM.embed`` / ``LLM.encode`` turn it into the outputs below."""
    kv_transfer_params: dict[str, Any] | None = None
    """What the KV connector returned with the finished request (vLLM's ``kv_transfer_params``:
    a prefill instance's answer says where its KV waits for the decode instance)."""


@dataclass
class PoolingOutput:
    """A pooled vector (vLLM's ``PoolingOutput``)."""

    data: torch.Tensor
    """[dimensions] float32."""


@dataclass
class EmbeddingOutput:
    """An embedding (vLLM's ``EmbeddingOutput``)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class PoolingRequestOutput:
    """The result of one pooling request (vLLM's ``PoolingRequestOutput``): ``outputs`` is a
    ``PoolingOutput`` from ``LLM.encode``, an ``EmbeddingOutput`` from ``LLM.embed``."""

    request_id: str
    outputs: PoolingOutput | EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0


@dataclass
class EmbeddingRequestOutput(PoolingRequestOutput):
    """``LLM.embed``'s result: ``outputs.embedding`` is the vector as a list."""

    outputs: EmbeddingOutput


__all__ = [
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "Logprob",
    "PoolingOutput",
    "PoolingRequestOutput",
    "PositionLogprobs",
    "PromptLogprobs",
    "RequestMetrics",
    "RequestOutput",
    "SampleLogprobs",
]
