"""Kiln's rejection sampler: speculative sampling that keeps the model's distribution exactly.

Per draft position with the model's distribution ``p`` (after the row's logits processors,
temperature, top-k, top-p and min-p, as the sampler draws) and the proposer's ``q``:
- greedy rows accept the draft while it is the argmax, and emit the argmax where it is not;
- random rows accept draft ``t`` with probability ``min(1, p(t) / q(t))`` and otherwise draw from
  ``max(p - q, 0)`` normalised (for ngram ``q`` is one-hot, so: accept with ``p(t)``, else draw
  from ``p`` without ``t``). A request's output is its leading accepted drafts, then the token of
  the first rejected position, or, all accepted, the bonus token drawn at its last position.
  Each emitted token is then distributed as ``p`` given the tokens before it (Leviathan et al.,
  2023), so speculation changes speed, never the output distribution.

Draws: the residual and bonus draws are the sampler's own (``random_sample``: one exponential
``[V]`` row per position, seeded rows from their generator), then one uniform per draft position.
A row without drafts therefore draws exactly what the plain sampler draws, and a seeded request
that does not speculate gets the same tokens as without speculation.

It knows nothing about requests or the scheduler; one host read of the draft ids when some row
is seeded (to draw uniforms only for draft positions).
"""

from __future__ import annotations

import torch

from kiln.sampling.metadata import SamplingMetadata
from kiln.sampling.sampler import compute_probs, random_sample
from kiln.sampling_params import SAMPLING_EPS
from kiln.spec_decode.interface import RejectionOutput, RejectionSamplerBase


class RejectionSampler(RejectionSamplerBase):
    """See the module docstring."""

    def forward(
        self,
        logits: torch.Tensor,
        metadata: SamplingMetadata,
        draft_token_ids: torch.Tensor,
        draft_probs: torch.Tensor | None,
    ) -> RejectionOutput:
        is_draft = draft_token_ids >= 0  # [P]
        greedy = None
        if not metadata.all_random:
            greedy = logits.argmax(dim=-1)  # [P]
            if metadata.all_greedy:
                return RejectionOutput(greedy, is_draft & (greedy == draft_token_ids))
        drafts = draft_token_ids.clamp(min=0).unsqueeze(1)  # [P, 1]
        probs = compute_probs(logits, metadata)  # [P, V]
        p_draft = probs.gather(1, drafts).squeeze(1)  # [P]
        if draft_probs is None:
            # One-hot q: min(1, p/q) is p(t); max(p - q, 0) is p without t.
            accept_prob = p_draft
            residual = probs.scatter(1, drafts, 0.0)
            residual = torch.where(is_draft.unsqueeze(1), residual, probs)
        else:
            q_draft = draft_probs.gather(1, drafts).squeeze(1)
            accept_prob = (p_draft / q_draft).clamp(max=1.0)
            residual = torch.where(
                is_draft.unsqueeze(1), (probs - draft_probs).clamp(min=0.0), probs
            )
        # Unnormalised weights are fine: the exponential race draws proportionally to them.
        drawn = random_sample(residual, metadata.generators)  # [P]
        uniform = self._uniform(draft_token_ids, metadata.generators)  # [P]
        accepted = is_draft & (uniform < accept_prob)
        token_ids = torch.where(accepted, draft_token_ids, drawn)
        if greedy is not None:
            is_greedy = metadata.temperature < SAMPLING_EPS
            token_ids = torch.where(is_greedy, greedy, token_ids)
            accepted = torch.where(is_greedy, is_draft & (greedy == draft_token_ids), accepted)
        return RejectionOutput(token_ids, accepted)

    @staticmethod
    def _uniform(
        draft_token_ids: torch.Tensor, generators: dict[int, torch.Generator]
    ) -> torch.Tensor:
        """[P] uniforms in [0, 1); seeded rows draw theirs, at draft positions only."""
        uniform = torch.rand(draft_token_ids.shape, device=draft_token_ids.device)
        if generators:
            draft_ids = draft_token_ids.tolist()
            for row, generator in generators.items():
                if draft_ids[row] >= 0:
                    uniform[row] = torch.rand(
                        1, generator=generator, device=draft_token_ids.device
                    )[0]
        return uniform
