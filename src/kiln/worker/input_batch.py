"""The persistent batch: the state of running requests, kept between steps.

The model runner keeps one row per request it holds. Each step it applies only the diff the
scheduler sent (new and resumed requests in, finished and preempted ones out, new blocks appended,
sampled tokens appended) instead of rebuilding the batch. Rows stay contiguous: removing a request
moves the last row into its place.

Per-row state lives in NumPy arrays (token ids, counts, block table) so preparing a step's inputs
is a few vectorised gathers. This module knows nothing about models or attention backends.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kiln.messages import NewRequestData
from kiln.sampling.metadata import SamplingMetadata, make_generator
from kiln.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    output_token_ids: list[int]
    """Generated tokens; the sampling metadata holds this very list (penalties read it)."""


class InputBatch:
    """Rows of running requests.

    Args:
        max_num_reqs: most rows (``max_num_seqs``).
        max_model_len: most tokens per request.
        max_num_blocks_per_req: block-table width.
        vocab_size: the logits' width (for sampling metadata).
        device: where sampling tensors go.
    """

    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_num_blocks_per_req: int,
        vocab_size: int,
        device: torch.device,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.device = device
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.req_ids: list[str] = []
        self.req_id_to_index: dict[str, int] = {}
        self.requests: list[CachedRequestState] = []
        self._sampling_cache: tuple[tuple[str, ...], SamplingMetadata] | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def add_request(self, new: NewRequestData) -> int:
        """Add a new or resumed request as the last row; returns its row.

        Raises:
            ValueError: the batch is full or the request is longer than ``max_model_len``.
        """
        if self.num_reqs >= self.max_num_reqs:
            raise ValueError(f"the batch already holds max_num_seqs={self.max_num_reqs} requests")
        tokens = new.prompt_token_ids + new.output_token_ids
        if len(tokens) > self.token_ids.shape[1]:
            raise ValueError(f"request {new.req_id} has {len(tokens)} tokens > max_model_len")
        row = self.num_reqs
        self._sampling_cache = None  # a resumed request may reuse an id with fresh state
        params = new.sampling_params
        generator = None
        if params.seed is not None:
            generator = make_generator(params.seed, self.device)
            # Resumed after preemption: replay the draws of the tokens it already sampled (one
            # Exp(1) row of the vocabulary's width per token, as the sampler draws), so a seed
            # gives the same tokens whether or not the request was preempted.
            noise = torch.empty(self.vocab_size, device=self.device)
            for _ in new.output_token_ids:
                noise.exponential_(generator=generator)
        state = CachedRequestState(
            new.req_id,
            new.prompt_token_ids,
            params,
            generator,
            list(new.output_token_ids),
        )
        self.req_ids.append(new.req_id)
        self.req_id_to_index[new.req_id] = row
        self.requests.append(state)
        self.token_ids[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_prompt_tokens[row] = len(new.prompt_token_ids)
        self.num_computed_tokens[row] = new.num_computed_tokens
        self.num_blocks[row] = 0
        self.append_blocks(row, new.block_ids)
        return row

    def remove_request(self, req_id: str) -> None:
        """Drop ``req_id`` (unknown ids are ignored); the last row moves into its place."""
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return
        self._sampling_cache = None
        last = self.num_reqs - 1
        if row != last:
            moved = self.req_ids[last]
            self.req_ids[row], self.requests[row] = moved, self.requests[last]
            self.req_id_to_index[moved] = row
            for array in (
                self.token_ids,
                self.num_tokens,
                self.num_prompt_tokens,
                self.num_computed_tokens,
                self.block_table,
                self.num_blocks,
            ):
                array[row] = array[last]
        self.req_ids.pop()
        self.requests.pop()

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        if block_ids:
            start = int(self.num_blocks[row])
            self.block_table[row, start : start + len(block_ids)] = block_ids
            self.num_blocks[row] = start + len(block_ids)

    def append_token(self, row: int, token_id: int) -> None:
        n = int(self.num_tokens[row])
        self.token_ids[row, n] = token_id
        self.num_tokens[row] = n + 1
        self.requests[row].output_token_ids.append(token_id)

    def sampling_metadata(self, rows: list[int]) -> SamplingMetadata:
        """Sampling metadata for ``rows`` in that order, rebuilt only when the batch changes."""
        key = tuple(self.req_ids[row] for row in rows)
        if self._sampling_cache is not None and self._sampling_cache[0] == key:
            return self._sampling_cache[1]
        states = [self.requests[row] for row in rows]
        needs_prompt = any(s.sampling_params.repetition_penalty != 1.0 for s in states)
        metadata = SamplingMetadata.from_params(
            [s.sampling_params for s in states],
            [s.output_token_ids for s in states],
            [s.prompt_token_ids for s in states] if needs_prompt else None,
            {i: s.generator for i, s in enumerate(states) if s.generator is not None},
            self.vocab_size,
            self.device,
        )
        self._sampling_cache = (key, metadata)
        return metadata
