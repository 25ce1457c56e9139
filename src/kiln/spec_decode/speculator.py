"""The model runner's speculative-decoding part: the platform's proposer and rejection sampler,
and the glue between them and the runner's persistent batch.

Per step the runner's speculative sampling strategy (``kiln.worker.sampling``) asks it to (1)
put the scheduled drafts after each row's tokens, where the runner reads its scheduled tokens
(``write_drafts``), (2) build one sampling-metadata row per logits position
(``expand_metadata``), (3) verify the drafts against the logits (``verify``) and, after the
step's tokens are in the batch, (4) draft the next step's tokens (``propose``).

It reads the runner's persistent batch (``BatchView``: what it uses of the runner's
``InputBatch``, which sits in a layer above) and writes only the drafts' slots of its token
array; it knows nothing about scheduling.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

from kiln.config import KilnConfig
from kiln.plugins.interfaces import resolve_class
from kiln.sampling.metadata import SamplingMetadata
from kiln.sampling.sampler import LogprobsTensors, Sampler, gather_logprobs
from kiln.sampling_params import SamplingParams
from kiln.spec_decode.interface import ProposalInputs
from kiln.spec_decode.verify import expand_metadata


class RequestView(Protocol):
    """What the speculator reads of one request in the batch."""

    @property
    def prompt_token_ids(self) -> list[int]: ...
    @property
    def sampling_params(self) -> SamplingParams: ...
    @property
    def generator(self) -> torch.Generator | None: ...
    @property
    def output_token_ids(self) -> list[int]: ...


class BatchView(Protocol):
    """What the speculator reads of the runner's persistent batch (rows of running requests)."""

    @property
    def req_ids(self) -> list[str]: ...
    @property
    def requests(self) -> Sequence[RequestView]: ...
    @property
    def token_ids(self) -> np.ndarray:
        """[max_num_reqs, max_model_len] int64; the speculator writes drafts after a row's
        tokens."""

    @property
    def num_tokens(self) -> np.ndarray:
        """[max_num_reqs] int64."""

    @property
    def block_table(self) -> np.ndarray:
        """[max_num_reqs, max_num_blocks_per_req] int32."""

    @property
    def num_blocks(self) -> np.ndarray:
        """[max_num_reqs] int64."""

    @property
    def vocab_size(self) -> int: ...
    def sampling_metadata(self, rows: list[int]) -> SamplingMetadata: ...


class Speculator:
    """The proposer and rejection sampler of ``config.device`` (see the module docstring).

    Raises:
        ValueError: speculation with ``parallel.pipeline_parallel_size > 1``.
        InterfaceError: a class named in ``device.proposer_cls`` / ``rejection_sampler_cls`` that
            does not implement its interface.
    """

    def __init__(self, config: KilnConfig, device: torch.device) -> None:
        if config.parallel.pipeline_parallel_size > 1:
            # Earlier stages take one sampled token per request from the last (see the runner's
            # FollowLastStage, kiln.worker.output); several per step would need their counts.
            raise ValueError(
                "speculative.method is not supported with parallel.pipeline_parallel_size > 1"
            )
        self.device = device
        classes = config.device
        self.proposer = resolve_class("proposer_cls", classes.proposer_cls)(config, device)
        sampler_cls = resolve_class("rejection_sampler_cls", classes.rejection_sampler_cls)
        self.rejection_sampler = sampler_cls()

    def load_model(self, target_model: Any, platform: Any) -> None:
        self.proposer.load_model(target_model, platform)

    def get_kv_cache_bytes_per_block(self) -> int:
        return int(self.proposer.get_kv_cache_bytes_per_block())

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.proposer.initialize_kv_cache(num_blocks)

    def remove_requests(self, req_ids: list[str]) -> None:
        if req_ids:
            self.proposer.remove_requests(req_ids)

    def write_drafts(
        self, batch: BatchView, rows: list[int], spec_tokens: dict[str, list[int]]
    ) -> list[list[int]] | None:
        """Put each row's drafts after its tokens (where its scheduled tokens are read); returns
        the drafts per row, or None when no row has any."""
        if not spec_tokens:
            return None
        drafts = []
        for row in rows:
            draft = spec_tokens.get(batch.req_ids[row], [])
            if draft:
                num_tokens = int(batch.num_tokens[row])
                batch.token_ids[row, num_tokens : num_tokens + len(draft)] = draft
            drafts.append(draft)
        return drafts

    def expand_metadata(
        self, batch: BatchView, rows: list[int], drafts: list[list[int]]
    ) -> SamplingMetadata:
        """One sampling-metadata row per logits position of ``rows`` (see ``expand_metadata``)."""
        states = [batch.requests[row] for row in rows]
        return expand_metadata(
            [s.sampling_params for s in states],
            [s.output_token_ids for s in states],
            [s.prompt_token_ids for s in states],
            [s.generator for s in states],
            drafts,
            batch.vocab_size,
            self.device,
        )

    def verify(
        self,
        sampler: Sampler,
        logits: torch.Tensor,
        metadata: SamplingMetadata,
        req_ids: list[str],
        drafts: list[list[int]],
    ) -> tuple[LogprobsTensors | None, tuple[list[int], list[bool]]]:
        """The rejection sampler's verdict on the drafts: the logprobs of every position's token,
        and per position its token and whether its draft was accepted (read back: the step's
        host sync). ``logits``: [P, V], one row per position; ``sampler`` applies the logits
        processors; ``req_ids`` and ``drafts``: per request."""
        logits = sampler.apply_logits_processors(logits.float(), metadata)
        draft_ids = torch.tensor(
            [t for draft in drafts for t in (*draft, -1)], dtype=torch.int64, device=self.device
        )  # [P]
        draft_probs = self.proposer.draft_probs(req_ids, [len(d) for d in drafts])  # [P, V]
        result = self.rejection_sampler.forward(logits, metadata, draft_ids, draft_probs)
        logprobs_tensors = None
        if metadata.max_num_logprobs is not None:
            logprobs_tensors = gather_logprobs(
                logits.log_softmax(dim=-1), metadata.max_num_logprobs, result.token_ids
            )
        return logprobs_tensors, (result.token_ids.tolist(), result.is_accepted.tolist())

    def propose(
        self, batch: BatchView, rows: list[int], sampled_token_ids: list[list[int]]
    ) -> list[list[int]]:
        """The proposer's drafts for the next step, per row ([] where it emitted nothing). A
        request with a grammar drafts too: the scheduler keeps what its grammar allows."""
        indices = [i for i in range(len(rows)) if sampled_token_ids[i]]
        spec_token_ids: list[list[int]] = [[] for _ in rows]
        if indices:
            draft_rows = [rows[i] for i in indices]
            inputs = ProposalInputs(
                batch.token_ids,
                batch.num_tokens,
                draft_rows,
                [batch.req_ids[row] for row in draft_rows],
                batch.block_table,
                batch.num_blocks,
                batch.sampling_metadata(draft_rows),
            )
            for i, draft in zip(indices, self.proposer.propose(inputs), strict=True):
                spec_token_ids[i] = draft
        return spec_token_ids
