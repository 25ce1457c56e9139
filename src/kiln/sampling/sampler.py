"""The batched sampler: one step's logits and ``SamplingMetadata`` in, one token id per row out.

Contract: ``Sampler.forward(logits [B, V], metadata) -> SamplerOutput``, one row per request, in the
order below (as vLLM v1). The input logits are never modified.

1. logits processors, for every row (greedy ones too): logit bias, then ``min_tokens`` (EOS and stop
   token ids set to -inf while a row has fewer than ``min_tokens`` output tokens), then penalties
   (repetition on prompt and output tokens; frequency and presence on output tokens);
2. logprobs, when any row asks for them: ``log_softmax`` of the logits after step 1 (so they reflect
   bias, masking and penalties, but not temperature or top-k/top-p/min-p: they describe the model's
   adjusted distribution, not the truncated one the token was drawn from);
3. greedy rows: argmax of the logits after step 1;
4. random rows: divide by temperature, mask with top-k, then top-p, then min-p, softmax, and draw
   with exponential noise (``argmax(probs / q)``, ``q ~ Exp(1)``, as gpt-fast), which picks token
   ``i`` with probability ``probs[i]``. A seeded row draws its ``q`` from its own generator, one
   ``[V]`` draw per step, so it yields the same tokens whatever else is in the batch.

No host syncs: the sampler branches only on python values in the metadata (flags, dicts, lists) and
never calls ``.item()`` / ``.tolist()``; the caller reads the results back once per step.

What it must not know: requests, tokenizers, text, stop strings, the scheduler. It sees token ids
and floats only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.sampling.metadata import SamplingMetadata, pad_token_ids
from kiln.sampling_params import SAMPLING_EPS


@dataclass
class LogprobsTensors:
    """Logprobs of N positions: column 0 is the chosen token, columns 1.. the top-k tokens.

    Rows that asked for fewer than ``k`` top logprobs read only their first columns.
    """

    logprob_token_ids: torch.Tensor
    """[N, k + 1] int64."""
    logprobs: torch.Tensor
    """[N, k + 1] float32."""
    selected_token_ranks: torch.Tensor
    """[N] int64: 1-based rank of column 0's token (number of tokens with logprob >= its own)."""

    def tolists(self) -> tuple[list[list[int]], list[list[float]], list[int]]:
        """Read back to python (host syncs: call once per step, outside the sampler)."""
        return (
            self.logprob_token_ids.tolist(),
            self.logprobs.tolist(),
            self.selected_token_ranks.tolist(),
        )


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor
    """[B] int64."""
    logprobs_tensors: LogprobsTensors | None
    """Set when ``metadata.max_num_logprobs`` is not None; ``k`` is ``max_num_logprobs``."""


class Sampler(torch.nn.Module):
    """Turns the last-position logits of each request into its next token (see module docstring)."""

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        # logits: [B, V]
        logits = self.apply_logits_processors(logits.float(), metadata)
        logprobs = None
        if metadata.max_num_logprobs is not None:
            logprobs = logits.log_softmax(dim=-1)  # [B, V]
        sampled = self.sample(logits, metadata)  # [B]
        logprobs_tensors = None
        if logprobs is not None:
            assert metadata.max_num_logprobs is not None
            logprobs_tensors = gather_logprobs(logprobs, metadata.max_num_logprobs, sampled)
        return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=logprobs_tensors)

    def apply_logits_processors(
        self, logits: torch.Tensor, metadata: SamplingMetadata
    ) -> torch.Tensor:
        """Step 1: allowed token ids, bad words, logit bias, min_tokens, penalties. Returns a
        new tensor (or ``logits``)."""
        if metadata.allowed_token_ids:
            logits = apply_allowed_token_ids(logits, metadata.allowed_token_ids)
        if metadata.bad_words:
            logits = apply_bad_words(logits, metadata.bad_words, metadata.output_token_ids)
        if metadata.logit_bias is not None:
            logits = apply_logit_bias(logits, metadata.logit_bias)
        if metadata.min_tokens:
            logits = apply_min_tokens(logits, metadata.min_tokens, metadata.output_token_ids)
        if not metadata.no_penalties:
            logits = apply_penalties(
                logits,
                metadata.prompt_token_ids,
                metadata.output_token_ids,
                metadata.presence_penalties,
                metadata.frequency_penalties,
                metadata.repetition_penalties,
            )
        return logits

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Steps 3 and 4: [B, V] processed logits -> [B] int64 token ids."""
        greedy = None
        if not metadata.all_random:
            greedy = logits.argmax(dim=-1)  # [B]
            if metadata.all_greedy:
                return greedy
        random = random_sample(compute_probs(logits, metadata), metadata.generators)  # [B]
        if greedy is None:
            return random
        return torch.where(metadata.temperature < SAMPLING_EPS, greedy, random)


def compute_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Step 4 up to the draw: the distribution each random row samples from. [B, V] processed
    logits -> new [B, V] probabilities (temperature, top-k, top-p, min-p, softmax). Greedy rows
    get their temperature-1 distribution (their draw is thrown away)."""
    is_greedy = metadata.temperature < SAMPLING_EPS  # [B]
    # Greedy rows divide by 1: their random draw is thrown away, but must not be inf/nan.
    temperature = torch.where(is_greedy, 1.0, metadata.temperature)
    logits = logits / temperature.unsqueeze(1)
    top_k = None if metadata.no_top_k else metadata.top_k
    top_p = None if metadata.no_top_p else metadata.top_p
    if top_p is not None and top_k is not None and metadata.all_random_top_k:
        logits = apply_top_k_top_p_partial(logits, top_k, top_p, metadata.max_top_k)
    elif top_p is not None:
        logits = apply_top_k_top_p(logits, top_k, top_p)
    elif top_k is not None:
        logits = apply_top_k_only(logits, top_k, metadata.max_top_k)
    if not metadata.no_min_p:
        logits = apply_min_p(logits, metadata.min_p)
    return logits.softmax(dim=-1)


def apply_logit_bias(
    logits: torch.Tensor, logit_bias: list[dict[int, float] | None]
) -> torch.Tensor:
    """Add ``logit_bias[row][token]`` to ``logits[row, token]``. [B, V] -> new [B, V]."""
    rows: list[int] = []
    token_ids: list[int] = []
    values: list[float] = []
    for row, bias in enumerate(logit_bias):
        if bias:
            rows.extend([row] * len(bias))
            token_ids.extend(bias.keys())
            values.extend(bias.values())
    index = torch.tensor([rows, token_ids], dtype=torch.int64, device=logits.device)  # [2, n]
    bias_values = torch.tensor(values, dtype=logits.dtype, device=logits.device)  # [n]
    return logits.index_put((index[0], index[1]), bias_values, accumulate=True)


def apply_allowed_token_ids(
    logits: torch.Tensor, allowed_token_ids: dict[int, list[int]]
) -> torch.Tensor:
    """Set every logit of a row in ``allowed_token_ids`` to -inf but its allowed ids'.
    [B, V] -> new [B, V]."""
    banned = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    for row, token_ids in allowed_token_ids.items():
        banned[row] = True
        banned[row, torch.tensor(token_ids, dtype=torch.int64, device=logits.device)] = False
    return logits.masked_fill(banned, float("-inf"))


def apply_bad_words(
    logits: torch.Tensor,
    bad_words: dict[int, list[list[int]]],
    output_token_ids: list[list[int]],
) -> torch.Tensor:
    """Set to -inf, per row, the last token of each bad word whose other tokens end the row's
    output so far (a one-token word: always). [B, V] -> new [B, V] (or ``logits``)."""
    rows: list[int] = []
    token_ids: list[int] = []
    for row, sequences in bad_words.items():
        output = output_token_ids[row]
        for sequence in sequences:
            prefix = len(sequence) - 1
            if prefix == 0 or (len(output) >= prefix and output[-prefix:] == sequence[:-1]):
                rows.append(row)
                token_ids.append(sequence[-1])
    if not rows:
        return logits
    index = torch.tensor([rows, token_ids], dtype=torch.int64, device=logits.device)  # [2, n]
    neg_inf = torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device)
    return logits.index_put((index[0], index[1]), neg_inf)


def apply_min_tokens(
    logits: torch.Tensor,
    min_tokens: dict[int, tuple[int, set[int]]],
    output_token_ids: list[list[int]],
) -> torch.Tensor:
    """Set the stop token ids of rows below their ``min_tokens`` to -inf, unless that leaves a
    row no token at all (a grammar mask that allows only stop tokens). [B, V] -> new [B, V]."""
    vocab_size = logits.shape[1]
    rows: list[int] = []
    token_ids: list[int] = []
    for row, (num_min_tokens, stop_ids) in min_tokens.items():
        if len(output_token_ids[row]) < num_min_tokens:
            ids = [t for t in stop_ids if t < vocab_size]
            rows.extend([row] * len(ids))
            token_ids.extend(ids)
    if not rows:
        return logits
    index = torch.tensor([rows, token_ids], dtype=torch.int64, device=logits.device)  # [2, n]
    neg_inf = torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device)
    masked = logits.index_put((index[0], index[1]), neg_inf)
    # A row left with no token (a structured-output grammar that allows only EOS) keeps its
    # stop tokens: the grammar wins over min_tokens. On device, no host sync.
    has_token = (masked > float("-inf")).any(dim=1, keepdim=True)  # [B, 1]
    return torch.where(has_token, masked, logits)


def _token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, L] int64 ids padded with ``vocab_size`` -> [B, V] float32 occurrence counts."""
    counts = torch.zeros(
        token_ids.shape[0], vocab_size + 1, dtype=torch.float32, device=token_ids.device
    )
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor | None,
    output_token_ids: list[list[int]],
    presence_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    repetition_penalties: torch.Tensor,
) -> torch.Tensor:
    """Penalise repeats, as vLLM. [B, V] -> new [B, V].

    For a token seen in the row's prompt or output, repetition divides a positive logit by the
    row's ``repetition_penalty`` and multiplies a negative one. Then, with ``c`` the number of times
    the token occurs in the output, ``logit -= frequency_penalty * c + presence_penalty * (c > 0)``.

    Args:
        prompt_token_ids: [B, P] padded with V, or None (repetition then looks at output only).
        output_token_ids: per row, the generated tokens.
        *_penalties: [B] each.
    """
    vocab_size = logits.shape[1]
    output_ids = pad_token_ids(output_token_ids, vocab_size, logits.device)  # [B, L]
    output_counts = _token_counts(output_ids, vocab_size)  # [B, V]
    in_output = output_counts > 0  # [B, V]
    seen = in_output
    if prompt_token_ids is not None:
        seen = seen | (_token_counts(prompt_token_ids, vocab_size) > 0)
    repetition = torch.where(seen, repetition_penalties.unsqueeze(1), 1.0)  # [B, V]
    logits = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits -= frequency_penalties.unsqueeze(1) * output_counts
    logits -= presence_penalties.unsqueeze(1) * in_output
    return logits


def apply_top_k_only(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Keep each row's ``top_k`` largest logits (ties with the k-th are kept), -inf the rest.

    One ``topk`` of width ``max_top_k`` instead of a sort. Rows with ``top_k >= V`` are untouched.
    [B, V] -> new [B, V].
    """
    vocab_size = logits.shape[1]
    is_off = top_k >= vocab_size  # [B]
    k = torch.where(is_off, 1, top_k).clamp(max=max_top_k)  # [B], in [1, max_top_k]
    top_values = logits.topk(max_top_k, dim=-1).values  # [B, max_top_k], descending
    kth_value = top_values.gather(1, (k - 1).unsqueeze(1))  # [B, 1]
    kth_value = kth_value.masked_fill(is_off.unsqueeze(1), float("-inf"))
    return logits.masked_fill(logits < kth_value, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor
) -> torch.Tensor:
    """Top-k then top-p with one ascending sort (as vLLM). [B, V] -> new [B, V].

    Top-p keeps, of the tokens left by top-k, the smallest set of most likely tokens whose
    probabilities (renormalised over that set) add up to at least ``top_p``; the most likely
    token always stays.
    """
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)  # [B, V] each
    vocab_size = logits.shape[1]
    if top_k is not None:
        # The k-th largest value sits at index V - k of the ascending sort.
        kth_value = logits_sort.gather(1, (vocab_size - top_k).unsqueeze(1))  # [B, 1]
        logits_sort.masked_fill_(logits_sort < kth_value, float("-inf"))
    probs_sum = logits_sort.softmax(dim=-1).cumsum_(dim=-1)  # [B, V], ascending
    # A token goes when the tokens above it already hold at least top_p of the mass.
    drop = probs_sum <= 1 - top_p.unsqueeze(1)
    drop[:, -1] = False
    logits_sort.masked_fill_(drop, float("-inf"))
    return logits_sort.scatter(dim=-1, index=logits_idx, src=logits_sort)


def apply_top_k_top_p_partial(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, max_top_k: int
) -> torch.Tensor:
    """``apply_top_k_top_p`` for batches where every row has ``top_k < V``. [B, V] -> new [B, V].

    Sorts only the ``max_top_k`` largest logits (one ``topk``) instead of the whole vocabulary:
    the same tokens survive, except that ties with the ``max_top_k``-th value beyond the ``topk``
    are dropped rather than kept. Rows with ``top_k >= V`` are cut to ``max_top_k``, which is
    why the caller keeps this for batches whose only such rows are greedy.
    """
    values, indices = logits.topk(max_top_k, dim=-1)  # [B, K] each, descending
    k = top_k.clamp(max=max_top_k)  # [B]
    kth_value = values.gather(1, (k - 1).unsqueeze(1))  # [B, 1]
    values = values.masked_fill(values < kth_value, float("-inf"))
    probs = values.softmax(dim=-1)  # [B, K], renormalised over the top-k set
    # A token goes when the tokens above it already hold at least top_p of the mass.
    mass_above = probs.cumsum(dim=-1) - probs  # [B, K]
    values = values.masked_fill(mass_above >= top_p.unsqueeze(1), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, indices, values)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens with ``prob < min_p * max_prob``. [B, V] -> new [B, V].

    Done on logits: ``p_i < min_p * p_max`` iff ``logit_i < logit_max + log(min_p)``, which needs no
    softmax; ``min_p == 0`` gives ``log(0) = -inf`` and drops nothing.
    """
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)  # [B, 1]
    return logits.masked_fill(logits < threshold, float("-inf"))


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Draw one token per row from ``probs`` [B, V] (rows sum to 1) -> [B] int64.

    ``argmax(probs / q)`` with ``q ~ Exp(1)`` i.i.d. picks ``i`` with probability ``probs[i]`` (the
    exponential race). Seeded rows take ``q`` from their own generator; the rest from the default
    one. Side effect: consumes ``probs`` (divides it in place).
    """
    q = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        q.exponential_()
    for row, generator in generators.items():
        q[row].exponential_(generator=generator)
    return probs.div_(q).argmax(dim=-1)


def gather_logprobs(
    logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor
) -> LogprobsTensors:
    """Column 0: the logprob of ``token_ids``; columns 1..k: the top ``num_logprobs``.

    Args:
        logprobs: [N, V] float32.
        num_logprobs: k >= 0 (capped at V).
        token_ids: [N] int64, the chosen token per row.
    """
    token_ids = token_ids.unsqueeze(1)  # [N, 1]
    token_logprobs = logprobs.gather(1, token_ids)  # [N, 1]
    ranks = (logprobs >= token_logprobs).sum(dim=-1)  # [N]
    num_top = min(num_logprobs, logprobs.shape[1])
    if num_top > 0:
        top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)  # [N, k] each
        token_ids = torch.cat([token_ids, top_ids], dim=1)
        token_logprobs = torch.cat([token_logprobs, top_logprobs], dim=1)
    return LogprobsTensors(
        logprob_token_ids=token_ids, logprobs=token_logprobs, selected_token_ranks=ranks
    )


def compute_prompt_logprobs(
    logits: torch.Tensor, target_ids: torch.Tensor, num_logprobs: int
) -> LogprobsTensors:
    """Logprobs of the prompt tokens, for ``prompt_logprobs`` and OpenAI ``echo`` + ``logprobs``.

    Args:
        logits: [T, V], row ``t`` predicts the token at position ``t + 1``; raw model output
            (no penalties or temperature, as vLLM).
        target_ids: [T] int64, the prompt token at position ``t + 1``.
        num_logprobs: top logprobs to return besides the target's.

    Returns:
        ``LogprobsTensors`` whose column 0 holds each target's logprob ([T]) and its rank.
    """
    return gather_logprobs(logits.float().log_softmax(dim=-1), num_logprobs, target_ids)
