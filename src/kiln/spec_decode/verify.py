"""The model runner's side of verification: which logits to compute, the sampling metadata of
every position, and each request's emitted tokens.

A request verifying ``k`` drafts is scheduled ``1 + k`` tokens (its last token, then the drafts);
its logits are computed at all ``1 + k`` positions: position ``j`` predicts the token after
``j`` drafts, the last one is the bonus position. A request without drafts has one position, as
without speculation. Positions are in request order (``cu[i] .. cu[i+1] - 1``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kiln.sampling.metadata import SamplingMetadata
from kiln.sampling_params import SamplingParams


def logits_positions(query_start_loc: np.ndarray, num_drafts: np.ndarray) -> np.ndarray:
    """Token indices whose logits are computed: each request's last ``1 + num_drafts`` scheduled
    tokens. [num_reqs + 1] query starts, [num_reqs] draft counts -> [P] int64."""
    num_positions = num_drafts + 1  # [R]
    cu = np.cumsum(num_positions)  # [R]
    req = np.repeat(np.arange(len(num_drafts)), num_positions)  # [P]
    offset = np.arange(int(cu[-1])) - (cu - num_positions)[req]  # [P], 0..k per request
    return query_start_loc[1:][req] - num_positions[req] + offset


def expand_metadata(
    params: Sequence[SamplingParams],
    output_token_ids: Sequence[list[int]],
    prompt_token_ids: Sequence[list[int]],
    generators: Sequence[torch.Generator | None],
    drafts: Sequence[list[int]],
    vocab_size: int,
    device: torch.device,
) -> SamplingMetadata:
    """Sampling metadata with one row per position: request ``i``'s row ``j`` has its params and,
    as output so far, its output tokens and its first ``j`` drafts (penalties and min_tokens see
    what would precede the token there). Seeded requests' rows share their generator.

    Args (one entry per request): the params, output tokens, prompt tokens, generator (None when
    not seeded) and drafts.
    """
    rows_params: list[SamplingParams] = []
    rows_output: list[list[int]] = []
    rows_prompt: list[list[int]] = []
    rows_generators: dict[int, torch.Generator] = {}
    needs_prompt = any(p.repetition_penalty != 1.0 for p in params)
    for p, output, prompt, generator, draft in zip(
        params, output_token_ids, prompt_token_ids, generators, drafts, strict=True
    ):
        for j in range(len(draft) + 1):
            if generator is not None:
                rows_generators[len(rows_params)] = generator
            rows_params.append(p)
            rows_output.append(output + draft[:j] if j else output)
            if needs_prompt:
                rows_prompt.append(prompt)
    return SamplingMetadata.from_params(
        rows_params,
        rows_output,
        rows_prompt if needs_prompt else None,
        rows_generators,
        vocab_size,
        device,
    )


def emitted_tokens(
    token_ids: list[int], is_accepted: list[bool], num_drafts: Sequence[int]
) -> list[list[int]]:
    """Each request's tokens: its leading accepted drafts, then the next position's token.

    Args:
        token_ids, is_accepted: per position, from the rejection sampler (read back).
        num_drafts: per request.
    """
    result = []
    start = 0
    for k in num_drafts:
        n = 0
        while n < k and is_accepted[start + n]:
            n += 1
        result.append(token_ids[start : start + n + 1])
        start += k + 1
    return result
