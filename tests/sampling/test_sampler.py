"""The batched sampler: filters, penalties, masking, logprobs, seeded determinism, statistics."""

import math

import pytest
import torch

from kiln.sampling import Sampler, SamplingMetadata, compute_prompt_logprobs, make_generator
from kiln.sampling.sampler import (
    apply_min_p,
    apply_penalties,
    apply_top_k_only,
    apply_top_k_top_p,
    apply_top_k_top_p_partial,
)
from kiln.sampling_params import SamplingParams

NEG_INF = float("-inf")


def build(params, vocab_size, outputs=None, prompts=None, seeds=True):
    """Metadata for ``params``; seeded rows get a fresh generator from their seed."""
    outputs = outputs if outputs is not None else [[] for _ in params]
    generators = {}
    if seeds:
        generators = {
            row: make_generator(p.seed, "cpu") for row, p in enumerate(params) if p.seed is not None
        }
    return SamplingMetadata.from_params(params, outputs, prompts, generators, vocab_size, "cpu")


def kept(logits_row):
    return set(torch.nonzero(torch.isfinite(logits_row)).flatten().tolist())


def log_probs(*probs):
    return torch.tensor(probs, dtype=torch.float32).log()


# --- filters ---------------------------------------------------------------------------------


def test_top_k_keeps_exactly_k():
    torch.manual_seed(0)
    logits = torch.randn(3, 20)
    top_k = torch.tensor([1, 5, 20])  # 20 == V: off
    out = apply_top_k_only(logits, top_k, max_top_k=5)
    for row, k in enumerate([1, 5, 20]):
        assert kept(out[row]) == set(logits[row].topk(k).indices.tolist())
        finite = torch.isfinite(out[row])
        assert torch.equal(out[row][finite], logits[row][finite])  # kept values untouched
    # The sort path (top-p off) masks the same.
    out_sort = apply_top_k_top_p(logits, top_k, torch.ones(3))
    assert torch.equal(torch.isfinite(out_sort), torch.isfinite(out))


def test_top_p_keeps_smallest_set_reaching_p():
    # Token order shuffled so the scatter back to vocabulary order is exercised.
    logits = log_probs(0.15, 0.5, 0.05, 0.3).expand(4, 4)
    out = apply_top_k_top_p(logits, None, torch.tensor([0.4, 0.75, 0.85, 1.0]))
    assert [kept(row) for row in out] == [{1}, {1, 3}, {0, 1, 3}, {0, 1, 2, 3}]
    finite = torch.isfinite(out)
    assert torch.equal(out[finite], logits[finite])


def test_top_p_matches_reference_on_random_rows():
    torch.manual_seed(1)
    logits = torch.randn(16, 50) * 2
    top_p = torch.rand(16) * 0.9 + 0.05
    out = apply_top_k_top_p(logits, None, top_p)
    for row in range(16):
        probs = logits[row].softmax(-1)
        order = probs.argsort(descending=True).tolist()
        total, expected = 0.0, set()
        for token in order:
            expected.add(token)
            total += probs[token].item()
            if total >= top_p[row].item():
                break
        assert kept(out[row]) == expected


def test_top_p_applies_to_renormalised_top_k_set():
    # After top-k=3 the probs are [0.444, 0.333, 0.222]; top-p=0.75 then keeps two tokens.
    # Without renormalisation 0.4 + 0.3 < 0.75 would keep three.
    logits = log_probs(0.4, 0.3, 0.2, 0.1).unsqueeze(0)
    out = apply_top_k_top_p(logits, torch.tensor([3]), torch.tensor([0.75]))
    assert kept(out[0]) == {0, 1}


def test_partial_top_k_top_p_matches_sort_path():
    torch.manual_seed(9)
    logits = torch.randn(16, 200) * 2
    top_k = torch.randint(1, 60, (16,))
    top_p = torch.rand(16) * 0.9 + 0.05
    top_p[:4] = 1.0  # top-k alone decides these rows
    full = apply_top_k_top_p(logits, top_k, top_p)
    partial = apply_top_k_top_p_partial(logits, top_k, top_p, int(top_k.max()))
    assert torch.equal(full, partial)
    # Both filters bite somewhere, so the comparison covers both.
    num_kept = torch.isfinite(full).sum(-1)
    assert (num_kept < top_k).any() and (num_kept == top_k).any()
    out = apply_top_k_top_p_partial(
        log_probs(0.4, 0.3, 0.2, 0.1)[None], top_k[:1] * 0 + 3, torch.tensor([0.75]), 3
    )
    assert kept(out[0]) == {0, 1}


def test_min_p_is_relative_to_max_prob():
    logits = log_probs(0.1, 0.5, 0.04, 0.2, 0.16).expand(3, 5)
    out = apply_min_p(logits, torch.tensor([0.3, 0.0, 0.39]))
    # Thresholds: 0.15, 0 (off), 0.195.
    assert [kept(row) for row in out] == [{1, 3, 4}, {0, 1, 2, 3, 4}, {1, 3}]


def test_filters_through_sampler_only_draw_kept_tokens():
    logits = log_probs(0.3, 0.25, 0.2, 0.15, 0.1).expand(2000, 5)
    params = [SamplingParams(top_k=2)] * 1000 + [SamplingParams(top_p=0.7)] * 1000
    torch.manual_seed(2)
    tokens = Sampler()(logits, build(params, 5)).sampled_token_ids
    assert set(tokens[:1000].tolist()) == {0, 1}
    assert set(tokens[1000:].tolist()) == {0, 1, 2}


# --- greedy, logits processors ---------------------------------------------------------------


def test_greedy_is_argmax_alone_and_mixed():
    torch.manual_seed(3)
    logits = torch.randn(6, 100)
    sampler = Sampler()
    out = sampler(logits, build([SamplingParams(temperature=0)] * 6, 100))
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.sampled_token_ids.dtype == torch.int64 and out.logprobs_tensors is None
    mixed = [SamplingParams(temperature=0), SamplingParams(temperature=1.5, top_k=3)] * 3
    out = sampler(logits, build(mixed, 100))
    assert torch.equal(out.sampled_token_ids[0::2], logits[0::2].argmax(-1))


def test_penalties_by_hand():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0], [2.0, -1.0, 0.5, -0.5, 3.0]])
    prompt = torch.tensor([[0, 5], [3, 3]])  # padded with V = 5
    outputs = [[1, 1, 2], []]
    out = apply_penalties(
        logits,
        prompt,
        outputs,
        presence_penalties=torch.tensor([0.25, 0.25]),
        frequency_penalties=torch.tensor([0.5, 0.5]),
        repetition_penalties=torch.tensor([2.0, 4.0]),
    )
    expected = torch.tensor(
        [
            # 0: in prompt, positive -> 2 / 2.
            # 1: output twice, negative -> -1 * 2 - 0.5 * 2 - 0.25.
            # 2: output once, positive -> 0.5 / 2 - 0.5 - 0.25.  3, 4: unseen.
            [1.0, -3.25, -0.5, -0.5, 3.0],
            # Row 2 has no output: only repetition on prompt token 3 (negative -> * 4).
            [2.0, -1.0, 0.5, -2.0, 3.0],
        ]
    )
    torch.testing.assert_close(out, expected)


def test_penalties_and_bias_reach_greedy_choice():
    logits = torch.tensor([[0.0, 3.0, 2.9, 0.0]])
    md = build([SamplingParams(temperature=0, presence_penalty=0.2)], 4, outputs=[[1]])
    assert Sampler()(logits, md).sampled_token_ids.tolist() == [2]
    md = build([SamplingParams(temperature=0, logit_bias={3: 3.5})], 4)
    assert Sampler()(logits, md).sampled_token_ids.tolist() == [3]


def test_logit_bias_adds_per_row():
    logits = torch.zeros(3, 5)
    params = [SamplingParams(logit_bias={3: 5.0, 1: -2.5}), SamplingParams(), SamplingParams()]
    params[2] = SamplingParams(logit_bias={0: 1.0})
    out = Sampler().apply_logits_processors(logits, build(params, 5))
    expected = torch.tensor([[0, -2.5, 0, 5.0, 0], [0] * 5, [1.0, 0, 0, 0, 0]])
    torch.testing.assert_close(out, expected)
    assert torch.equal(logits, torch.zeros(3, 5))  # input untouched


def test_min_tokens_masks_stop_ids_until_reached():
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[4])
    params.update_from_generation_config({}, model_eos_token_id=2)
    logits = torch.tensor([[0.0, 1.0, 9.0, 0.0, 8.0]])
    sampler = Sampler()
    for num_out, expected in [(0, 1), (2, 1), (3, 2)]:
        md = build([params], 5, outputs=[[0] * num_out])
        processed = sampler.apply_logits_processors(logits, md)
        masked = {2, 4} if num_out < 3 else set()
        assert {i for i in range(5) if processed[0, i] == NEG_INF} == masked
        assert sampler(logits, md).sampled_token_ids.tolist() == [expected]


def test_allowed_token_ids_mask_only_their_rows():
    logits = torch.arange(6, dtype=torch.float32).repeat(2, 1)  # token 5 most likely
    params = [SamplingParams(temperature=0, allowed_token_ids=[3, 1, 3]), SamplingParams()]
    md = build(params, 6)
    processed = Sampler().apply_logits_processors(logits, md)
    assert kept(processed[0]) == {1, 3} and kept(processed[1]) == set(range(6))
    assert processed[0, 3] == 3.0
    assert Sampler()(logits[:1], build(params[:1], 6)).sampled_token_ids.tolist() == [3]


def test_bad_words_mask_the_last_token_after_their_prefix():
    params = SamplingParams(temperature=0, bad_words=["unused"])
    params._bad_words_token_ids = [[4], [1, 2, 3]]  # as update_from_tokenizer would set them
    logits = torch.zeros(1, 6)
    sampler = Sampler()
    for output, masked in [([], {4}), ([1], {4}), ([0, 1, 2], {3, 4}), ([1, 2, 0], {4})]:
        processed = sampler.apply_logits_processors(logits, build([params], 6, outputs=[output]))
        assert set(range(6)) - kept(processed[0]) == masked, output


def test_bad_words_are_tokenized_as_written_and_after_a_space():
    params = SamplingParams(bad_words=["cat", " dog"])
    vocab = {"cat": [7], " cat": [8, 7], " dog": [9]}
    params.update_from_tokenizer(lambda text: vocab[text])
    assert params.bad_words_token_ids == [[7], [8, 7], [9]]


# --- logprobs --------------------------------------------------------------------------------


def test_logprobs_are_log_softmax_of_processed_logits():
    torch.manual_seed(4)
    logits = torch.randn(3, 30)
    params = [
        SamplingParams(temperature=0.5, logprobs=3, logit_bias={7: 4.0}),
        SamplingParams(temperature=0, logprobs=1, frequency_penalty=1.0),
        SamplingParams(top_k=5, seed=11),
    ]
    outputs = [[], [2, 2], []]
    md = build(params, 30, outputs=outputs)
    out = Sampler()(logits, md)
    processed = logits.clone()
    processed[0, 7] += 4.0
    processed[1, 2] -= 2.0
    expected = processed.log_softmax(-1)  # no temperature, no top-k: the adjusted distribution
    lt = out.logprobs_tensors
    assert lt.logprobs.shape == (3, 4) and lt.logprob_token_ids.shape == (3, 4)
    sampled = out.sampled_token_ids
    assert torch.equal(lt.logprob_token_ids[:, 0], sampled)
    torch.testing.assert_close(lt.logprobs[:, 0], expected.gather(1, sampled[:, None])[:, 0])
    top = expected.topk(3, dim=-1)
    assert torch.equal(lt.logprob_token_ids[:, 1:], top.indices)
    torch.testing.assert_close(lt.logprobs[:, 1:], top.values)
    ranks = [(expected[r] >= expected[r, sampled[r]]).sum().item() for r in range(3)]
    assert lt.selected_token_ranks.tolist() == ranks
    assert sampled[1].item() == expected[1].argmax().item() and ranks[1] == 1
    ids, lps, rks = lt.tolists()
    assert ids[0][0] == sampled[0].item() and len(lps[2]) == 4 and rks == ranks


def test_prompt_logprobs():
    torch.manual_seed(5)
    logits = torch.randn(4, 12)
    targets = torch.tensor([3, 0, 11, 5])
    lt = compute_prompt_logprobs(logits, targets, num_logprobs=2)
    expected = logits.log_softmax(-1)
    torch.testing.assert_close(lt.logprobs[:, 0], expected[torch.arange(4), targets])
    assert torch.equal(lt.logprob_token_ids[:, 0], targets)
    assert torch.equal(lt.logprob_token_ids[:, 1:], expected.topk(2).indices)
    ranks = [(expected[t] >= expected[t, targets[t]]).sum().item() for t in range(4)]
    assert lt.selected_token_ranks.tolist() == ranks
    assert compute_prompt_logprobs(logits, targets, 0).logprobs.shape == (4, 1)


# --- randomness ------------------------------------------------------------------------------


def _run_steps(batch_logits, params, row, num_steps):
    """Sample ``num_steps`` steps with persistent generators; return row ``row``'s tokens."""
    md_generators = {
        r: make_generator(p.seed, "cpu") for r, p in enumerate(params) if p.seed is not None
    }
    sampler, tokens = Sampler(), []
    outputs = [[] for _ in params]
    for step in range(num_steps):
        md = SamplingMetadata.from_params(params, outputs, None, md_generators, 1000, "cpu")
        sampled = sampler(batch_logits[step], md).sampled_token_ids.tolist()
        for r, t in enumerate(sampled):
            outputs[r].append(t)
        tokens.append(sampled[row])
    return tokens


def test_seeded_request_is_independent_of_batch():
    steps = 6
    gen = torch.Generator().manual_seed(6)
    target_logits = torch.randn(steps, 1000, generator=gen)  # the seeded request's logits
    target = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, logprobs=2)

    torch.manual_seed(100)
    alone = _run_steps(target_logits[:, None], [target], 0, steps)

    # Same request at row 3, among unseeded, greedy, other-seeded and min-p rows.
    others = [
        SamplingParams(),
        SamplingParams(temperature=0),
        SamplingParams(seed=99, top_k=40),
        SamplingParams(min_p=0.1, presence_penalty=0.5),
    ]
    batch = torch.randn(steps, 5, 1000, generator=gen)
    batch[:, 3] = target_logits
    torch.manual_seed(200)  # a different default generator state must not matter
    in_batch = _run_steps(batch, others[:3] + [target] + others[3:], 3, steps)
    assert in_batch == alone

    batch2 = torch.randn(steps, 2, 1000, generator=gen)
    batch2[:, 0] = target_logits
    torch.manual_seed(300)
    assert _run_steps(batch2, [target, SamplingParams(top_k=3)], 0, steps) == alone

    # The seed matters: another seed gives another sequence (so the checks above can fail).
    other_seed = SamplingParams(temperature=0.9, top_p=0.95, seed=1235)
    assert _run_steps(target_logits[:, None], [other_seed], 0, steps) != alone


def _chi_square(tokens, probs):
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    return ((counts - expected) ** 2 / expected).sum().item()


# 99.9th percentile of chi-square with 5 degrees of freedom.
CHI2_DF5_999 = 20.52


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sampling_matches_softmax_distribution(temperature):
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0])
    num_draws = 40_000
    md = build([SamplingParams(temperature=temperature)] * num_draws, 6)
    torch.manual_seed(7)
    tokens = Sampler()(logits.expand(num_draws, 6), md).sampled_token_ids
    probs = (logits / temperature).softmax(-1)
    assert _chi_square(tokens, probs) < CHI2_DF5_999
    # The test has power: the temperature-1 distribution is rejected at temperature 0.5.
    if temperature != 1.0:
        assert _chi_square(tokens, logits.softmax(-1)) > 10 * CHI2_DF5_999


def test_seeded_rows_match_softmax_distribution():
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0])
    num_draws = 4_000
    params = [SamplingParams(seed=seed) for seed in range(num_draws)]
    tokens = Sampler()(logits.expand(num_draws, 6), build(params, 6)).sampled_token_ids
    assert _chi_square(tokens, logits.softmax(-1)) < CHI2_DF5_999


def test_sampler_has_no_host_sync_and_keeps_input(monkeypatch):
    torch.manual_seed(8)
    logits = torch.randn(4, 50)
    original = logits.clone()
    params = [
        SamplingParams(temperature=0, logit_bias={1: 1.0}, logprobs=2),
        SamplingParams(top_k=5, top_p=0.8, min_p=0.05, seed=3, repetition_penalty=1.3),
        SamplingParams(top_k=7, frequency_penalty=0.5, min_tokens=2, stop_token_ids=[4]),
        SamplingParams(temperature=0.7),
    ]
    md = build(params, 50, outputs=[[1], [2, 3], [5], []], prompts=[[1], [2], [3], [4]])

    def no_sync(*args, **kwargs):
        raise AssertionError("host sync inside the sampler")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, no_sync)
    out = Sampler()(logits, md)
    monkeypatch.undo()
    assert out.sampled_token_ids.shape == (4,)
    assert torch.equal(logits, original)
    assert math.isfinite(out.logprobs_tensors.logprobs[0, 0].item())
