"""The rejection sampler keeps the target's distribution: chi-square of many independent draws
against the target probabilities computed here (not by the code under test), for one-hot drafts
(ngram) and for a draft distribution, with a control sampler that accepts every draft and must
fail the same test. Greedy rows: accept exactly while the draft is the argmax."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.sampling.metadata import SamplingMetadata, make_generator
from kiln.sampling.sampler import Sampler
from kiln.sampling_params import SamplingParams
from kiln.spec_decode.interface import RejectionOutput
from kiln.spec_decode.rejection_sampler import RejectionSampler

TARGET = np.array([0.30, 0.25, 0.20, 0.15, 0.07, 0.03])
NUM_TRIALS = 20_000
# Chi-square critical values at p = 0.001 by degrees of freedom (a fixed seed makes each test
# deterministic; this only says how far from the target a count may be).
CHI2_CRITICAL_001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}


class AlwaysAccept(RejectionSampler):
    """The control: accepts every draft (what a broken verification would do)."""

    def forward(self, logits, metadata, draft_token_ids, draft_probs) -> RejectionOutput:
        out = super().forward(logits, metadata, draft_token_ids, draft_probs)
        is_draft = draft_token_ids >= 0
        return RejectionOutput(torch.where(is_draft, draft_token_ids, out.token_ids), is_draft)


def chi_square(tokens: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Statistic and degrees of freedom of ``tokens`` against ``probs`` (cells with p > 0)."""
    counts = np.bincount(tokens, minlength=len(probs))
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    expected = probs[keep] * len(tokens)
    return float(((counts[keep] - expected) ** 2 / expected).sum()), int(keep.sum()) - 1


def run(
    sampler: RejectionSampler,
    drafts: np.ndarray,
    params: SamplingParams,
    draft_probs: torch.Tensor | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """NUM_TRIALS independent requests, each one draft then its bonus position, over TARGET at
    both positions. Returns the first emitted token, whether the draft was accepted, and the
    bonus position's token."""
    torch.manual_seed(0)
    num_positions = 2 * NUM_TRIALS
    logits = torch.tensor(np.log(TARGET), dtype=torch.float32).repeat(num_positions, 1)
    metadata = SamplingMetadata.from_params(
        [params] * num_positions, [[] for _ in range(num_positions)], None, {}, len(TARGET), "cpu"
    )
    draft_ids = torch.full((num_positions,), -1, dtype=torch.int64)
    draft_ids[0::2] = torch.from_numpy(drafts)
    if draft_probs is not None:
        draft_probs = draft_probs.repeat_interleave(2, dim=0)
    out = sampler.forward(logits, metadata, draft_ids, draft_probs)
    tokens = out.token_ids.numpy()
    return tokens[0::2], out.is_accepted.numpy()[0::2], tokens[1::2]


def expected_probs(temperature: float = 1.0, top_k: int = 0) -> np.ndarray:
    weights = TARGET ** (1 / temperature)
    if top_k:
        weights = np.where(weights >= np.sort(weights)[-top_k], weights, 0.0)
    return weights / weights.sum()


@pytest.mark.parametrize("draft_token", [0, 4])
@pytest.mark.parametrize(("temperature", "top_k"), [(1.0, 0), (0.7, 3)])
def test_one_hot_drafts_keep_the_target_distribution(
    draft_token: int, temperature: float, top_k: int
) -> None:
    params = SamplingParams(temperature=temperature, top_k=top_k)
    drafts = np.full(NUM_TRIALS, draft_token)
    probs = expected_probs(temperature, top_k)
    first, accepted, bonus = run(RejectionSampler(), drafts, params)
    stat, df = chi_square(first, probs)
    assert stat < CHI2_CRITICAL_001[df], (stat, np.bincount(first, minlength=6) / NUM_TRIALS)
    # The draft is accepted with its target probability; after an acceptance the bonus token
    # is a fresh draw from the target.
    assert abs(accepted.mean() - probs[draft_token]) <= 4 * np.sqrt(probs[draft_token] / NUM_TRIALS)
    if accepted.sum() > 500:
        stat, df = chi_square(bonus[accepted], probs)
        assert stat < CHI2_CRITICAL_001[df]
    # The control fails the same test: every emitted token is the draft.
    first, _, _ = run(AlwaysAccept(), drafts, params)
    assert (first == draft_token).all()
    with pytest.raises(AssertionError):
        stat, df = chi_square(first, probs)
        assert stat < CHI2_CRITICAL_001[df]


def test_drafts_from_a_draft_distribution_keep_the_target_distribution() -> None:
    q = np.array([0.05, 0.10, 0.40, 0.05, 0.30, 0.10])
    rng = np.random.default_rng(1)
    drafts = rng.choice(len(q), size=NUM_TRIALS, p=q)
    draft_probs = torch.tensor(q, dtype=torch.float32).repeat(NUM_TRIALS, 1)
    params = SamplingParams(temperature=1.0)
    first, _, _ = run(RejectionSampler(), drafts, params, draft_probs)
    stat, df = chi_square(first, TARGET)
    assert stat < CHI2_CRITICAL_001[df], stat
    first, _, _ = run(AlwaysAccept(), drafts, params, draft_probs)  # emits q, not p
    stat, df = chi_square(first, TARGET)
    assert stat > CHI2_CRITICAL_001[df], stat


def test_greedy_accepts_exactly_while_the_draft_is_the_argmax() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0], [1.0, 4.0, 0.0]])
    metadata = SamplingMetadata.from_params(
        [SamplingParams(temperature=0.0)] * 4, [[], [], [], []], None, {}, 3, "cpu"
    )
    drafts = torch.tensor([1, 2, -1, -1])  # request 1: drafts 1 (argmax), 2 (not); request 2: none
    out = RejectionSampler().forward(logits, metadata, drafts, None)
    assert out.token_ids.tolist() == [1, 0, 2, 1]
    assert out.is_accepted.tolist() == [True, False, False, False]


def test_a_seeded_row_without_drafts_draws_what_the_sampler_draws() -> None:
    torch.manual_seed(3)
    logits = torch.randn(3, 50)
    params = [SamplingParams(temperature=1.0, seed=7)] * 3
    plain = SamplingMetadata.from_params(
        params[:1], [[]], None, {0: make_generator(7, "cpu")}, 50, "cpu"
    )
    expected = Sampler()(logits[2:3], plain).sampled_token_ids.item()
    # Rows 0-1: another seeded request with a draft; row 2: the plain seeded request.
    generators = {0: make_generator(11, "cpu"), 1: make_generator(11, "cpu")}
    generators[2] = make_generator(7, "cpu")
    metadata = SamplingMetadata.from_params(params, [[], [], []], None, generators, 50, "cpu")
    out = RejectionSampler().forward(logits, metadata, torch.tensor([5, -1, -1]), None)
    assert out.token_ids[2].item() == expected
