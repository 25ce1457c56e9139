"""The draft-model proposer, as vLLM's ``method: "draft_model"``: a smaller model with the
target's vocabulary drafts ``k`` tokens per request per step, by ``k`` forwards of its own.

Its KV cache: tensors of its own (one per draft layer, in the attention backend's layout) over
the target's block ids, so a token's draft keys and values sit in the slot where its target keys
and values sit. The draft reads each request's block table as it is and needs no allocator; the
engine sizes the blocks for both caches together (``get_kv_cache_bytes_per_block``) and the
scheduler allocates ``k`` lookahead slots after each request's scheduled tokens for the keys and
values of its drafts (``speculative.num_lookahead_tokens``), as vLLM does.

Per step, for every request that drafts, all at once:
1. a catch-up forward over the request's tokens that its draft cache lacks (from position 0 for
   a new or resumed request: the draft prefills the prompt; afterwards the one or few tokens the
   last verification emitted), with logits at its last token: draft 1;
2. ``k - 1`` decode forwards, draft ``j`` at its position giving draft ``j + 1``.
Greedy requests take the argmax; the others draw from ``q``, the draft's distribution under the
request's temperature, top-k, top-p and min-p, with the request's generator; ``draft_probs``
hands ``q`` to the rejection sampler, which keeps the target's distribution exactly.

The draft cache of a request is in step with its tokens: after a verification it is valid up to
the request's tokens before the drafts plus the drafts that were accepted (among those whose keys
were written); the catch-up writes over the rest. Prefix-cache hits do not help the draft: a
cached block is only known to hold the target's keys, so a request's first catch-up starts at 0.

It knows nothing about scheduling: ``ProposalInputs`` in, token ids out; one host sync per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kiln.config import KilnConfig, set_current_config
from kiln.forward_context import ForwardContext, set_forward_context
from kiln.model_executor.layers.attention import (
    CommonAttentionMetadata,
    allocate_kv_caches,
    get_attention_layers,
    resolve_attn_backend,
)
from kiln.model_executor.loader import get_loader, resolve_model_ref
from kiln.model_executor.model_loader import kv_cache_bytes_per_token, load_model
from kiln.sampling.metadata import SamplingMetadata
from kiln.sampling.sampler import compute_probs, random_sample
from kiln.sampling_params import SAMPLING_EPS
from kiln.spec_decode.interface import ProposalInputs, ProposerBase


@dataclass
class _DraftState:
    """One request's draft cache and latest proposal."""

    num_cached: int
    """Positions ``0 .. num_cached - 1`` hold the draft's keys and values of the request's
    tokens."""
    drafts: list[int]
    """The latest proposal: ``drafts[j]`` at position ``num_cached + j``; keys and values are
    written for all but the last."""
    probs: torch.Tensor | None
    """[len(drafts), V] the distribution each draft was drawn from; None for a greedy request."""


def num_matching(drafts: Sequence[int], tokens: Sequence[int]) -> int:
    """How many leading ``drafts`` equal the tokens at their positions."""
    n = 0
    while n < len(drafts) and n < len(tokens) and drafts[n] == tokens[n]:
        n += 1
    return n


class DraftModelProposer(ProposerBase):
    """Drafts with ``speculative.model`` (see the module docstring)."""

    def __init__(self, config: KilnConfig, device: torch.device) -> None:
        super().__init__(config, device)
        self.num_speculative_tokens = config.speculative.num_speculative_tokens
        self.block_size = config.cache.block_size
        self.dtype: torch.dtype = getattr(torch, config.model.dtype)
        self.attn_backend = resolve_attn_backend(config.device.attention_backend)
        self.model: Any = None
        self.hf_config: dict[str, Any] = {}
        self.max_model_len = 0
        """The draft's context: it drafts nothing at or past it."""
        self._states: dict[str, _DraftState] = {}

    def load_model(self, target_model: Any, platform: Any) -> None:
        """Load the draft with the target's loaders, dtype and platform.

        Raises:
            ValueError: the draft's vocabulary size is not the target's (names
                ``speculative.model``), or the loader's errors.
        """
        config = self.config
        spec = config.speculative
        assert spec.model is not None
        target_ref = resolve_model_ref(config.model.model)
        target_config = get_loader(target_ref, config.model.load_format).load_hf_config(target_ref)
        with set_current_config(config):
            self.model, self.hf_config = load_model(
                spec.model,
                self.dtype,
                self.device,
                quantization=spec.quantization,
                platform=platform,
            )
        vocab_size, target_vocab_size = self.hf_config["vocab_size"], target_config["vocab_size"]
        if vocab_size != target_vocab_size:
            raise ValueError(
                f"speculative.model={spec.model!r} is invalid: its vocabulary has {vocab_size} "
                f"tokens, the target's {target_vocab_size}; allowed: a draft model with the "
                "target's tokenizer"
            )
        self.max_model_len = int(self.hf_config.get("max_position_embeddings") or 2048)

    def get_kv_cache_bytes_per_block(self) -> int:
        return kv_cache_bytes_per_token(self.hf_config, self.dtype) * self.block_size

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_caches(
            self.model, self.attn_backend, num_blocks, self.block_size, self.dtype, self.device
        )
        self.attention_layers = get_attention_layers(self.model)
        builder_cls = self.attn_backend.get_metadata_builder_cls()
        self.metadata_builder = builder_cls(self.block_size, self.device)

    def remove_requests(self, req_ids: Sequence[str]) -> None:
        for req_id in req_ids:
            self._states.pop(req_id, None)

    def propose(self, inputs: ProposalInputs) -> list[list[int]]:
        assert inputs.block_table is not None and inputs.num_blocks is not None
        k = self.num_speculative_tokens
        num_reqs = len(inputs.rows)
        # Per request: its first position missing from the draft cache, its token count, how
        # many drafts it may make (the slots it holds and the draft's context bound the
        # positions it writes: draft j + 1 comes from draft j's keys at num_tokens + j - 1),
        # and its block table.
        starts, ends = [0] * num_reqs, [0] * num_reqs
        num_drafts = [0] * num_reqs
        tables: list[list[int]] = [[] for _ in range(num_reqs)]
        for i, (row, req_id) in enumerate(zip(inputs.rows, inputs.req_ids, strict=True)):
            ends[i] = num_tokens = int(inputs.num_tokens[row])
            num_slots = int(inputs.num_blocks[row]) * self.block_size
            num_drafts[i] = max(min(k, min(num_slots, self.max_model_len) - num_tokens + 1), 0)
            state = self._states.get(req_id)
            if state is not None:
                written = state.drafts[:-1]
                tokens = inputs.token_ids[row, state.num_cached : num_tokens].tolist()
                # Drafts that were not accepted left stale keys: start at the first of them.
                # At least the last token goes in again (draft 1 comes from its logits); when
                # the request was proposed for at its last step, that alone lands on the first
                # rejected draft, but its tokens may have moved on further since the proposal
                # (test_draft_cache_follows_the_accepted_tokens).
                start = state.num_cached + num_matching(written, tokens)
                starts[i] = min(start, num_tokens - 1)
            tables[i] = inputs.block_table[row, : inputs.num_blocks[row]].tolist()
        if not any(num_drafts):
            return [[] for _ in range(num_reqs)]
        sampled, probs = self._run(inputs, starts, ends, num_drafts, tables)
        token_lists = sampled.tolist()  # [k, R]: the step's one host sync
        drafts: list[list[int]] = []
        for i, req_id in enumerate(inputs.req_ids):
            draft = [token_lists[step][i] for step in range(num_drafts[i])]
            if draft:
                q = None if probs is None else probs[: num_drafts[i], i]
                self._states[req_id] = _DraftState(ends[i], draft, q)
            drafts.append(draft)
        return drafts

    def draft_probs(self, req_ids: Sequence[str], num_drafts: Sequence[int]) -> torch.Tensor | None:
        states = [self._states.get(req_id) for req_id in req_ids]
        if all(state is None or state.probs is None for state in states):
            return None  # greedy requests only: the rejection sampler takes the argmax
        vocab_size = int(self.hf_config["vocab_size"])
        rows = []
        for state, n in zip(states, num_drafts, strict=True):
            if n:
                assert state is not None and len(state.drafts) >= n, "drafts not proposed here"
                if state.probs is not None:
                    rows.append(state.probs[:n])
                else:  # a greedy request's drafts are certain
                    one_hot = torch.zeros(n, vocab_size, device=self.device)
                    ids = torch.tensor(state.drafts[:n], device=self.device).unsqueeze(1)
                    rows.append(one_hot.scatter_(1, ids, 1.0))
            rows.append(torch.zeros(1, vocab_size, device=self.device))  # the bonus position
        return torch.cat(rows)  # [P, V]

    # -- the draft's forwards ---------------------------------------------------------------
    def _run(
        self,
        inputs: ProposalInputs,
        starts: list[int],
        ends: list[int],
        num_drafts: list[int],
        tables: list[list[int]],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The catch-up forward and up to ``k - 1`` decode forwards of the ``R`` requests of
        ``inputs`` (those with ``num_drafts`` 0 sit out).

        Returns: ``[k', R]`` drafts (row ``j``: each request's draft ``j + 1``; past a request's
        ``num_drafts``, anything) and, unless all are greedy, ``[k', R, V]`` their ``q``.
        """
        metadata = inputs.sampling_metadata
        assert metadata is not None
        active = [i for i, n in enumerate(num_drafts) if n]
        token_ids = np.concatenate(
            [inputs.token_ids[inputs.rows[i], starts[i] : ends[i]] for i in active]
        )
        positions = np.concatenate([np.arange(starts[i], ends[i]) for i in active])
        logits = self._forward(
            token_ids,
            positions,
            [ends[i] - starts[i] for i in active],
            [starts[i] for i in active],
            [tables[i] for i in active],
        )
        sampled, q = self._sample(logits, metadata, active)
        all_sampled, all_q = [sampled], [q]
        for step in range(1, max(num_drafts)):
            # Draft ``step`` goes in at ends + step - 1, where its keys are written.
            active = [i for i in active if num_drafts[i] > step]
            positions = np.array([ends[i] + step - 1 for i in active])
            logits = self._forward(
                sampled[active],
                positions,
                [1] * len(active),
                positions.tolist(),
                [tables[i] for i in active],
            )
            sampled, q = self._sample(logits, metadata, active)
            all_sampled.append(sampled)
            all_q.append(q)
        if metadata.all_greedy:
            return torch.stack(all_sampled), None
        return torch.stack(all_sampled), torch.stack([q for q in all_q if q is not None])

    def _forward(
        self,
        token_ids: np.ndarray | torch.Tensor,
        positions: np.ndarray,
        query_lens: list[int],
        num_computed: list[int],
        tables: list[list[int]],
    ) -> torch.Tensor:
        """The draft's logits at each request's last new token: [num_reqs, V] float32."""
        common = CommonAttentionMetadata.from_block_tables(
            query_lens, num_computed, tables, self.block_size
        )
        input_ids = torch.as_tensor(token_ids, dtype=torch.int64).to(self.device)
        context = ForwardContext(
            self.metadata_builder.build(common),
            len(input_ids),
            attention_layers=self.attention_layers,
        )
        with set_forward_context(context):
            hidden_states = self.model(input_ids, torch.from_numpy(positions).to(self.device))
            last = common.query_start_loc[1:].to(torch.int64) - 1  # [num_reqs]
            return self.model.compute_logits(hidden_states[last.to(self.device)])

    def _sample(
        self, logits: torch.Tensor, metadata: SamplingMetadata, active: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft a token for each ``active`` request from its ``logits`` (row ``j`` is request
        ``active[j]``, which is ``metadata``'s row ``active[j]``): [R] tokens (the others': 0)
        and, unless all requests are greedy, [R, V] ``q`` (the others': uniform)."""
        num_reqs = metadata.num_reqs
        full = torch.zeros(num_reqs, logits.shape[1], device=logits.device)  # [R, V]
        full[active] = logits.float()
        greedy = full.argmax(dim=-1)  # [R]
        if metadata.all_greedy:
            return greedy, None
        probs = compute_probs(full, metadata)  # [R, V]
        is_active = set(active)
        generators = {i: g for i, g in metadata.generators.items() if i in is_active}
        drawn = random_sample(probs.clone(), generators)
        return torch.where(metadata.temperature < SAMPLING_EPS, greedy, drawn), probs
