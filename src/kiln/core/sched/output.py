"""What the scheduler hands the model runner each step, and what comes back.

Plain dataclasses (no tensors, no callables) so they cross process boundaries and so the scheduler
can be tested with hand-made ``ModelRunnerOutput``s. New (or resumed) requests carry their full
data; requests already running carry only what changed (new blocks, computed-token counts).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.messages import LogprobsLists
from kiln.sampling_params import SamplingParams


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


@dataclass
class CachedRequestData:
    """Running requests the runner already holds: only what changed, in parallel lists."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    """Blocks appended to each request's block table this step (often empty)."""
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    """request id -> tokens to compute this step."""
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]
    """Requests finished or preempted since the last step: the runner drops their state."""


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]
    """Per request in ``req_ids`` order: the sampled token, or [] for a partial prefill chunk."""
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    """Per request that asked for logprobs and sampled this step: the logprobs of its sampled
    token (one row each). Complete: the scheduler routes them as they are."""
    prompt_logprobs_dict: dict[str, LogprobsLists] = field(default_factory=dict)
    """Per request that asked for prompt logprobs and whose prefill finished this step (the step
    that samples its first token): all ``P - 1`` of them, never in chunks."""


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
