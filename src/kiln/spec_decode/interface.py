"""The speculative-decoding seams: the proposer and the rejection sampler a platform may replace.

A platform names its classes in ``device.proposer_cls`` and ``device.rejection_sampler_cls``
(``Platform.get_proposer_cls(config)``, ``Platform.get_rejection_sampler_cls()``); Kiln checks
them against ``ProposerBase`` and ``RejectionSamplerBase`` at start-up (``kiln plugins`` lists
them). Matching the interface is enough; subclassing Kiln's ``NgramProposer`` or
``RejectionSampler`` is the simple way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kiln.config import KilnConfig
from kiln.sampling.metadata import SamplingMetadata


@dataclass
class ProposalInputs:
    """What a proposer may read about the requests it drafts for (the runner's persistent batch).

    Row ``rows[i]`` of the arrays is the ``i``-th request to draft for; its tokens (prompt, then
    output, the one sampled this step included) are ``token_ids[row, :num_tokens[row]]``. The
    fields after ``rows`` are for proposers that run a model (the runner fills them).
    """

    token_ids: np.ndarray
    """[max_num_reqs, max_model_len] int64 (shared with the batch: read only)."""
    num_tokens: np.ndarray
    """[max_num_reqs] int64."""
    rows: list[int]
    """The rows to draft for, in output order."""
    req_ids: list[str] = field(default_factory=list)
    """The request id of each of ``rows`` (a proposer's per-request state is keyed by it)."""
    block_table: np.ndarray | None = None
    """[max_num_reqs, max_num_blocks_per_req] int32: each row's KV-cache block ids (read only);
    the first ``num_blocks[row]`` are its own. They cover the request's tokens and, with a draft
    model, ``num_speculative_tokens`` slots after its last scheduled token (the scheduler's
    lookahead), where a draft model may write its drafts' keys and values."""
    num_blocks: np.ndarray | None = None
    """[max_num_reqs] int64."""
    sampling_metadata: SamplingMetadata | None = None
    """One row per entry of ``rows``, in that order: the requests' sampling parameters and their
    generators (a proposer that samples draws as the request would)."""


class ProposerBase:
    """Drafts up to ``speculative.num_speculative_tokens`` tokens per request, once per step,
    after the step's tokens are sampled.

    Args:
        config: reads ``speculative.*``.
        device: the worker's device.
    """

    def __init__(self, config: KilnConfig, device: torch.device) -> None:
        self.config = config
        self.device = device

    def load_model(self, target_model: Any, platform: Any) -> None:
        """Load what the proposer runs (a draft model); called once after the target loads.

        Args:
            target_model: the model being served.
            platform: the process's ``Platform`` class, for ``kiln.model_executor.model_loader.
                load_model`` (the target's dtype and quantization rules).
        """

    def get_kv_cache_bytes_per_block(self) -> int:
        """Bytes of the proposer's own KV cache per block (0: it has none); the engine sizes the
        number of blocks for the target's and this together."""
        return 0

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the proposer's KV cache: ``num_blocks`` blocks with the target's block ids
        (called once, after the target's cache)."""

    def propose(self, inputs: ProposalInputs) -> list[list[int]]:
        """Draft tokens for each row of ``inputs.rows`` ([] where it has none).

        Must not change ``inputs``; at most ``num_speculative_tokens`` tokens per row.
        """
        raise NotImplementedError

    def draft_probs(self, req_ids: Sequence[str], num_drafts: Sequence[int]) -> torch.Tensor | None:
        """The distribution each verified draft was drawn from, for the rejection sampler.

        Args:
            req_ids: the requests verifying drafts this step, in position order.
            num_drafts: how many of its latest drafts each verifies (the scheduler may have cut
                them).

        Returns:
            [P, V] float32, request ``i``'s positions ``cu[i] .. cu[i+1] - 1`` (its drafts, then
            a bonus row, ignored), or None when every draft is certain (one-hot ``q``, as ngram).
        """
        return None

    def remove_requests(self, req_ids: Sequence[str]) -> None:
        """Forget these requests (finished, preempted, or resumed and to be started afresh)."""


@dataclass
class RejectionOutput:
    """Per logits position (request ``i``'s positions are ``cu[i] .. cu[i+1] - 1``: one per draft,
    then its bonus position)."""

    token_ids: torch.Tensor
    """[P] int64: the token each position emits: its draft when accepted, else the token drawn in
    its place; at a bonus position the token drawn there."""
    is_accepted: torch.Tensor
    """[P] bool: the position's draft was accepted (always False at a bonus position). A request
    emits its leading accepted drafts and then the next position's token."""


class RejectionSamplerBase:
    """Verifies drafts against the model's distribution at every position.

    The output distribution must be exactly the model's: greedy rows accept a draft while it is
    the argmax; random rows follow the speculative sampling rule (accept draft ``t`` with
    probability ``min(1, p(t) / q(t))``, else draw from ``max(p - q, 0)`` normalised).
    """

    def forward(
        self,
        logits: torch.Tensor,
        metadata: SamplingMetadata,
        draft_token_ids: torch.Tensor,
        draft_probs: torch.Tensor | None,
    ) -> RejectionOutput:
        """Verify one step's drafts.

        Args:
            logits: [P, V] float32, after the logits processors (bias, min_tokens, penalties) of
                each position's row in ``metadata``, before temperature.
            metadata: P rows, one per position (a position's output tokens include the drafts
                before it); seeded rows' generators are theirs.
            draft_token_ids: [P] int64; -1 at bonus positions.
            draft_probs: [P, V] the proposer's distribution at each draft position, or None for a
                proposer whose drafts are certain (one-hot ``q``, as ngram).
        """
        raise NotImplementedError
