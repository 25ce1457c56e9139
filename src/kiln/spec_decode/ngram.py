"""The ngram proposer (prompt lookup), as vLLM's ``method: "ngram"``: find the latest earlier
occurrence of the request's last ``n`` tokens (prompt and output alike), the longest ``n`` in
``[prompt_lookup_min, prompt_lookup_max]`` that occurs, and draft the tokens that followed it.

Runs on the CPU over the runner's persistent token array, per request, with NumPy: one
comparison over the request's tokens per step, then a few over the candidates that are left.
It drafts nothing where nothing matches, so non-repetitive text costs only that scan.
"""

from __future__ import annotations

import numpy as np
import torch

from kiln.config import KilnConfig
from kiln.spec_decode.interface import ProposalInputs, ProposerBase


def ngram_draft(tokens: np.ndarray, min_n: int, max_n: int, num_draft_tokens: int) -> list[int]:
    """Draft for ``tokens`` [N]: the up to ``num_draft_tokens`` tokens that followed the latest
    earlier occurrence of the longest suffix of ``n`` tokens, ``min_n <= n <= max_n``; [] when
    no such suffix occurs earlier."""
    last = len(tokens) - 1
    if last < min_n:
        return []
    # Candidate ends of an earlier occurrence: the positions before the last holding its token.
    ends = np.flatnonzero(tokens[:last] == tokens[last])
    length = 1
    for offset in range(1, min(max_n, last)):
        # Keep the ends whose occurrence also matches ``offset`` tokens further back.
        longer = ends[ends >= offset]
        longer = longer[tokens[longer - offset] == tokens[last - offset]]
        if not len(longer):
            break
        ends, length = longer, offset + 1
    if length < min_n or not len(ends):
        return []
    start = int(ends[-1]) + 1
    return tokens[start : start + num_draft_tokens].tolist()


class NgramProposer(ProposerBase):
    """Prompt lookup over each request's own tokens (see the module docstring)."""

    def __init__(self, config: KilnConfig, device: torch.device) -> None:
        super().__init__(config, device)
        spec = config.speculative
        self.num_speculative_tokens = spec.num_speculative_tokens
        self.min_n = spec.prompt_lookup_min
        self.max_n = spec.prompt_lookup_max

    def propose(self, inputs: ProposalInputs) -> list[list[int]]:
        return [
            ngram_draft(
                inputs.token_ids[row, : inputs.num_tokens[row]],
                self.min_n,
                self.max_n,
                self.num_speculative_tokens,
            )
            for row in inputs.rows
        ]
