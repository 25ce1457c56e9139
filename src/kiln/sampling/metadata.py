"""What the sampler needs to know about one step's batch, as batched tensors and python flags.

Contract: row ``i`` of every field is the request in row ``i`` of the logits. Per-request scalars
are tensors of shape ``[B]`` on the logits' device; sparse, per-request data (output tokens, logit
bias, min_tokens) stays in python structures that the sampler turns into index tensors once per
step. The ``all_*`` / ``no_*`` flags and ``max_top_k`` are python values computed from the params,
so the sampler can skip unused work without reading anything back from the device.

What it must not know: requests, the scheduler, tokenizers. ``from_params`` is the one place that
reads ``SamplingParams``; the model runner's persistent batch may later fill the same fields itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kiln.sampling_params import SAMPLING_EPS, SamplingParams


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor
    """[B] float32; below ``SAMPLING_EPS`` means greedy (the sampler divides by 1 instead)."""
    all_greedy: bool
    all_random: bool

    top_p: torch.Tensor
    """[B] float32; 1.0 when off."""
    top_k: torch.Tensor
    """[B] int64 in [1, vocab_size]; vocab_size when off."""
    min_p: torch.Tensor
    """[B] float32; 0.0 when off."""
    no_top_p: bool
    no_top_k: bool
    no_min_p: bool
    max_top_k: int
    """Largest ``top_k`` among rows that use top-k (0 when none): the width of one ``topk``."""
    all_random_top_k: bool
    """Every random row uses top-k, so top-p may look at only the ``max_top_k`` largest logits
    instead of sorting the whole vocabulary (greedy rows' random draw is thrown away)."""

    presence_penalties: torch.Tensor
    """[B] float32."""
    frequency_penalties: torch.Tensor
    """[B] float32."""
    repetition_penalties: torch.Tensor
    """[B] float32."""
    no_penalties: bool

    generators: dict[int, torch.Generator]
    """Row -> the request's own generator, for seeded rows; other random rows share the default."""

    output_token_ids: list[list[int]]
    """Tokens generated so far, per row (read for penalties and min_tokens)."""
    prompt_token_ids: torch.Tensor | None
    """[B, max_prompt_len] int64 padded with ``vocab_size``; only when a row has a repetition
    penalty (it applies to prompt and output tokens, as in vLLM), else None."""

    logit_bias: list[dict[int, float] | None] | None
    """Per row: token id -> bias; None when no row has one."""
    min_tokens: dict[int, tuple[int, set[int]]]
    """Row -> (min_tokens, token ids to mask) for rows that have not generated min_tokens yet. The
    sampler masks a row only while ``len(output_token_ids[row]) < min_tokens``."""

    max_num_logprobs: int | None
    """Most top logprobs any row asked for; None: no row wants logprobs."""

    allowed_token_ids: dict[int, list[int]] = field(default_factory=dict)
    """Row -> the only token ids it may sample, for rows with ``allowed_token_ids``."""
    bad_words: dict[int, list[list[int]]] = field(default_factory=dict)
    """Row -> its bad words as token-id sequences, for rows with ``bad_words``."""

    @property
    def num_reqs(self) -> int:
        return self.temperature.shape[0]

    @classmethod
    def from_params(
        cls,
        params_list: Sequence[SamplingParams],
        output_token_ids: list[list[int]],
        prompt_token_ids: Sequence[Sequence[int]] | None,
        generators: dict[int, torch.Generator],
        vocab_size: int,
        device: torch.device | str,
    ) -> SamplingMetadata:
        """Batch the params of the requests in batch order (row ``i`` is ``params_list[i]``).

        Args:
            params_list: one ``SamplingParams`` per row.
            output_token_ids: per row, the tokens generated so far (kept by reference).
            prompt_token_ids: per row, the prompt tokens; may be None when no row has a
                repetition penalty.
            generators: row -> generator for seeded rows (see ``make_generator``); rows with a seed
                but no generator here sample from the shared default generator.
            vocab_size: the logits' width.
            device: where the tensors go (the logits' device).

        Raises:
            ValueError: lengths differ, a logit_bias token id is outside the vocabulary, or a
                repetition penalty is set and ``prompt_token_ids`` is None.
        """
        num_reqs = len(params_list)
        if len(output_token_ids) != num_reqs:
            raise ValueError(
                f"output_token_ids must have one list per request ({num_reqs}), "
                f"got {len(output_token_ids)}"
            )
        temperature, top_p, top_k, min_p = [], [], [], []
        presence, frequency, repetition = [], [], []
        logit_bias: list[dict[int, float] | None] = []
        min_tokens: dict[int, tuple[int, set[int]]] = {}
        allowed: dict[int, list[int]] = {}
        bad_words: dict[int, list[list[int]]] = {}
        max_num_logprobs: int | None = None
        for row, params in enumerate(params_list):
            if params.allowed_token_ids is not None:
                allowed[row] = params.allowed_token_ids
            if params.bad_words_token_ids:
                bad_words[row] = params.bad_words_token_ids
            temperature.append(params.temperature)
            top_p.append(params.top_p)
            top_k.append(params.top_k if 0 < params.top_k < vocab_size else vocab_size)
            min_p.append(params.min_p)
            presence.append(params.presence_penalty)
            frequency.append(params.frequency_penalty)
            repetition.append(params.repetition_penalty)
            bias = params.logit_bias or None
            if bias is not None:
                bad = [t for t in bias if not 0 <= t < vocab_size]
                if bad:
                    raise ValueError(
                        f"logit_bias token ids must be in [0, {vocab_size}), got {bad[0]}"
                    )
            logit_bias.append(bias)
            stop_ids = params.all_stop_token_ids
            if stop_ids and len(output_token_ids[row]) < params.min_tokens:
                min_tokens[row] = (params.min_tokens, stop_ids)
            if params.logprobs is not None:
                max_num_logprobs = max(max_num_logprobs or 0, params.logprobs)

        # One host->device copy for all float per-row values; top_k (< 2**24) is exact in float32.
        columns = torch.tensor(
            [temperature, top_p, min_p, presence, frequency, repetition, top_k],
            dtype=torch.float32,
            device=device,
        )  # [7, B]
        is_greedy = [t < SAMPLING_EPS for t in temperature]
        used_top_k = [k for k in top_k if k < vocab_size]
        all_random_top_k = all(k < vocab_size or g for k, g in zip(top_k, is_greedy, strict=True))
        needs_prompt = any(r != 1.0 for r in repetition)
        no_penalties = not any(presence) and not any(frequency) and not needs_prompt
        prompt_tensor = None
        if needs_prompt:
            if prompt_token_ids is None:
                raise ValueError("prompt_token_ids is required when a repetition_penalty is set")
            prompt_tensor = pad_token_ids(prompt_token_ids, vocab_size, device)
        return cls(
            temperature=columns[0],
            all_greedy=all(is_greedy),
            all_random=not any(is_greedy),
            top_p=columns[1],
            top_k=columns[6].to(torch.int64),
            min_p=columns[2],
            no_top_p=all(p >= 1.0 for p in top_p),
            no_top_k=not used_top_k,
            no_min_p=not any(min_p),
            max_top_k=max(used_top_k, default=0),
            all_random_top_k=bool(used_top_k) and all_random_top_k,
            presence_penalties=columns[3],
            frequency_penalties=columns[4],
            repetition_penalties=columns[5],
            no_penalties=no_penalties,
            generators=generators,
            output_token_ids=output_token_ids,
            prompt_token_ids=prompt_tensor,
            logit_bias=logit_bias if any(b is not None for b in logit_bias) else None,
            min_tokens=min_tokens,
            max_num_logprobs=max_num_logprobs,
            allowed_token_ids=allowed,
            bad_words=bad_words,
        )


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """The generator a seeded request keeps for its whole life (one per request, not per step)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def pad_token_ids(
    token_ids: Sequence[Sequence[int]], pad_id: int, device: torch.device | str
) -> torch.Tensor:
    """Rows of token ids -> [len(token_ids), max_len] int64, padded with ``pad_id``."""
    max_len = max((len(ids) for ids in token_ids), default=0)
    padded = [list(ids) + [pad_id] * (max_len - len(ids)) for ids in token_ids]
    return torch.tensor(padded, dtype=torch.int64, device=device).reshape(len(token_ids), max_len)
