"""Speculative decoding in the scheduler (``kiln.spec_decode``): how many drafts a request may
verify, the lookahead slots a draft model writes into, and what a verified step takes back.

A decoding request verifies ``k`` drafts in a step of ``1 + k`` tokens; ``k`` is cut so that the
step's budget, the context and ``max_tokens`` hold even if every draft is accepted. After the step
the rejected drafts' computed slots are uncounted (their slots are written over later; only full
blocks of accepted tokens are cached). With a draft model, each allocation also holds
``num_lookahead_tokens`` slots after the scheduled tokens, within the context.

This module knows requests and token counts, not the scheduler's queues.
"""

from __future__ import annotations

from kiln.scheduler.request import Request


class DraftAccounting:
    """Draft limits and counters of one scheduler.

    Args:
        num_lookahead_tokens: KV slots allocated after a request's scheduled tokens (a draft
            model's drafts; 0 without one).
        max_model_len: the scheduler's context length.
    """

    def __init__(self, num_lookahead_tokens: int, max_model_len: int) -> None:
        self.num_lookahead_tokens = num_lookahead_tokens
        self.max_model_len = max_model_len
        self._stats = [0, 0, 0]  # drafts, draft tokens, accepted tokens since take_stats()

    def num_lookahead(self, num_tokens: int) -> int:
        """Lookahead slots for a request with ``num_tokens`` scheduled or computed: within the
        context (the block table of a request ends there)."""
        return max(min(self.num_lookahead_tokens, self.max_model_len - num_tokens), 0)

    def max_num_drafts(self, request: Request, token_budget: int) -> int:
        """The most drafts a decoding request may verify now: all of them and the bonus token
        must fit the budget, the context and ``max_tokens``."""
        limit = min(token_budget, self.max_model_len - request.num_tokens) - 1
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            limit = min(limit, max_tokens - request.num_output_tokens - 1)
        return max(limit, 0)

    def take_back_rejected(self, request: Request, num_drafts: int, num_new_tokens: int) -> None:
        """After verifying ``num_drafts`` drafts that yielded ``num_new_tokens`` tokens (the
        accepted drafts and one more): uncount the rejected drafts' computed slots."""
        num_accepted = num_new_tokens - 1
        request.num_computed_tokens -= num_drafts - num_accepted
        stats = self._stats
        stats[0] += 1
        stats[1] += num_drafts
        stats[2] += num_accepted

    def take_stats(self) -> tuple[int, int, int]:
        """``(drafts verified, draft tokens, accepted tokens)`` since the last call."""
        (drafts, draft_tokens, accepted), self._stats = self._stats, [0, 0, 0]
        return drafts, draft_tokens, accepted


__all__ = ["DraftAccounting"]
