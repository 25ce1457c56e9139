"""The speculative-decoding seams: the proposer and the rejection sampler a platform may replace.

A platform names its classes in ``device.proposer_cls`` and ``device.rejection_sampler_cls``
(``Platform.get_proposer_cls(config)``, ``Platform.get_rejection_sampler_cls()``); Kiln checks
them against ``ProposerBase`` and ``RejectionSamplerBase`` at start-up (``kiln plugins`` lists
them). Matching the interface is enough; subclassing Kiln's ``NgramProposer`` or
``RejectionSampler`` is the simple way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kiln.config import KilnConfig
from kiln.sampling.metadata import SamplingMetadata


@dataclass
class ProposalInputs:
    """What a proposer may read about the requests it drafts for (the runner's persistent batch).

    Row ``rows[i]`` of the arrays is the ``i``-th request to draft for; its tokens (prompt, then
    output, the one sampled this step included) are ``token_ids[row, :num_tokens[row]]``.
    """

    token_ids: np.ndarray
    """[max_num_reqs, max_model_len] int64 (shared with the batch: read only)."""
    num_tokens: np.ndarray
    """[max_num_reqs] int64."""
    rows: list[int]
    """The rows to draft for, in output order."""


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

    def load_model(self, target_model: Any) -> None:
        """Load what the proposer runs (a draft model); called once after the target loads."""

    def propose(self, inputs: ProposalInputs) -> list[list[int]]:
        """Draft tokens for each row of ``inputs.rows`` ([] where it has none).

        Must not change ``inputs``; at most ``num_speculative_tokens`` tokens per row.
        """
        raise NotImplementedError


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
