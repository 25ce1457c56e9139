"""Speculative decoding with a draft model (``method: "draft_model"``), on tiny random models that
share the default model's tokenizer: greedy output token for token as without speculation, with
another model as the draft (some drafts accepted) and with the target as its own draft (nearly
all accepted, sampled requests too, which needs the draft's probabilities); a batch that mixes
greedy, sampled and grammar-bound requests (JSON schema, regex, choice: valid, speculating, the
drafts their grammars forbid cut; sampled ones valid too);
stop strings, ``max_tokens`` and prefix-cache hits; tensor parallelism (TP=2); preemption while
speculating; the sampled distribution (with its control); a draft with another vocabulary
refused; and the proposer's draft cache against the draft model run on its own: in step with the
accepted tokens, and its probabilities those of the draft."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from spec_utils import (
    GRAMMAR_PROMPTS,
    GRAMMARS,
    AlwaysAccept,
    check_grammar_outputs,
    check_obeys_grammars,
    chi2_critical_001,
    grammar_params,
    homogeneity,
    record_draft_checks,
    results,
    sample_sequences,
    save_tiny_repeater,
    spec_counts,
)

from kiln import LLM, SamplingParams, platforms
from kiln.engine.arg_utils import EngineArgs
from kiln.sampling.metadata import SamplingMetadata, make_generator
from kiln.spec_decode.draft_model import DraftModelProposer
from kiln.spec_decode.interface import ProposalInputs
from kiln.testing.models import save_tiny_model

pytestmark = pytest.mark.slow

K = 3
COMMON = dict(dtype="float32", max_model_len=256, max_num_seqs=32, kv_cache_memory=0.05)
CODE = "def add(a, b):\n    total = a + b\n    return total\n"


@pytest.fixture(scope="module")
def target(gguf_path: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_repeater(tmp_path_factory.mktemp("target"), gguf_path)


@pytest.fixture(scope="module")
def draft(gguf_path: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    # Another random model, smaller: it agrees with the target on some tokens, not all.
    folder = tmp_path_factory.mktemp("draft")
    return save_tiny_repeater(folder, gguf_path, seed=1, num_hidden_layers=1)


@pytest.fixture(scope="module")
def plain(target: str) -> LLM:
    return LLM(target, **COMMON)


@pytest.fixture(scope="module")
def spec(target: str, draft: str) -> LLM:
    # No method: a model alone means a draft model, as in vLLM.
    return LLM(target, speculative_config={"model": draft, "num_speculative_tokens": K}, **COMMON)


@pytest.fixture(scope="module")
def spec_self(target: str) -> LLM:
    config = {"method": "draft_model", "model": target, "num_speculative_tokens": K}
    return LLM(target, speculative_config=config, **COMMON)


def _prompts(llm: LLM, n: int) -> list[list[int]]:
    tokenizer = llm.get_tokenizer()
    return [tokenizer.encode(f"Item {i}: {CODE}")[: 12 + 5 * i] for i in range(n)]


def _since(llm: LLM, before: tuple[int, int, int]) -> tuple[int, int, int]:
    now = spec_counts(llm)
    return now[0] - before[0], now[1] - before[1], now[2] - before[2]


def test_greedy_output_is_the_same_with_either_draft(plain: LLM, spec: LLM, spec_self: LLM) -> None:
    prompts = _prompts(plain, 5)
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = results(plain, prompts, greedy)
    # A stop string from the middle of an answer, and max_tokens inside a verified run.
    stop = expected[1][1][len(expected[1][1]) // 2 :][:4]
    params = [
        greedy,
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
        greedy,
        greedy,
    ]
    expected = results(plain, prompts, params)
    assert expected[1][2] == "stop" and expected[2][2] == "length"
    for llm in (spec, spec_self):
        before = spec_counts(llm)
        assert results(llm, prompts, params) == expected
        drafts, draft_tokens, accepted = _since(llm, before)
        assert drafts > 0, drafts
        if llm is spec:
            assert 0 < accepted < draft_tokens, (draft_tokens, accepted)
        else:  # the target drafting for itself: every draft is its argmax
            assert accepted >= 0.95 * draft_tokens, (draft_tokens, accepted)
    # Again: the prompts' blocks are prefix-cache hits now; the draft prefills them anyway.
    hits = spec.llm_engine.stats.totals.prefix_cache_hits
    assert results(spec, prompts, params) == expected
    assert spec.llm_engine.stats.totals.prefix_cache_hits > hits


def test_sampled_requests_with_the_target_as_draft_accept_nearly_all(spec_self: LLM) -> None:
    # p / q = 1 at every draft: all accepted when the rejection sampler is given q (with a
    # one-hot q it would accept draft t only with probability p(t)).
    before = spec_counts(spec_self)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=24) for i in range(8)]
    spec_self.generate(_prompts(spec_self, 8), params, use_tqdm=False)
    drafts, draft_tokens, accepted = _since(spec_self, before)
    assert drafts > 0 and accepted >= 0.95 * draft_tokens, (draft_tokens, accepted)


def test_seeded_sampled_requests_repeat(spec: LLM) -> None:
    """The same seeds and prompts give the same tokens again: the draft draws with the request's
    generator too (see docs/speculative-decoding.md on what seeds promise)."""
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=5 + i, max_tokens=24, ignore_eos=True)
        for i in range(4)
    ]
    prompts = _prompts(spec, 4)
    before = spec_counts(spec)
    first = results(spec, prompts, params)
    drafts, draft_tokens, accepted = _since(spec, before)
    assert drafts > 0 and 0 < accepted < draft_tokens, (drafts, draft_tokens, accepted)
    assert results(spec, prompts, params) == first


def test_mixed_batch_of_greedy_sampled_and_grammar_requests(
    plain: LLM, spec: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True)
    # A JSON schema, a regex and a choice (spec_utils.GRAMMARS) among speculating requests.
    prompts = [*_prompts(plain, 3), *GRAMMAR_PROMPTS]
    params = [greedy, sampled, greedy, *grammar_params()]
    checks = record_draft_checks(monkeypatch)
    before = spec_counts(spec)
    got = results(spec, prompts, params)
    expected = results(plain, prompts, params)
    # The random draft drafts what the grammars forbid: cut before verification.
    assert any(kept < proposed for proposed, kept in checks), checks
    # Greedy and grammar-bound requests as without speculation.
    assert [got[i] for i in (0, 2, 3, 4, 5)] == [expected[i] for i in (0, 2, 3, 4, 5)]
    assert got[1][2] == "length" and len(got[1][0]) == 24
    assert _since(spec, before)[2] > 0
    check_grammar_outputs(spec, got[3:])


def test_sampled_grammar_requests_obey_their_grammars(spec: LLM) -> None:
    """Sampled requests drafted from the draft's own distribution (unmasked): the rejection
    sampler verifies against the masked target at every position, so each output obeys its
    grammar."""
    seeds = range(4)
    params = [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=60, structured_outputs=grammar)
        for seed in seeds
        for grammar in GRAMMARS
    ]
    before = spec_counts(spec)
    got = results(spec, GRAMMAR_PROMPTS * len(seeds), params)
    check_obeys_grammars(GRAMMARS * len(seeds), got)
    assert _since(spec, before)[2] > 0


def test_tp2_greedy_output_is_the_same(target: str, draft: str, plain: LLM) -> None:
    """Tensor parallelism: the draft is built in the ranks' group, sharded as the target (each
    draft forward runs the collectives); every rank drafts and verifies the same tokens."""
    llm = LLM(
        target,
        tensor_parallel_size=2,
        speculative_config={"model": draft, "num_speculative_tokens": K},
        **COMMON,
    )
    prompts = _prompts(plain, 3)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    try:
        got = results(llm, prompts, params)
        drafts, draft_tokens, accepted = spec_counts(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert got == results(plain, prompts, params)
    assert drafts > 0 and 0 < accepted < draft_tokens, (drafts, draft_tokens, accepted)


BYTES_PER_BLOCK = (2 + 1) * 2 * 2 * 16 * 4 * 16  # target's 2 layers + draft's 1, K and V, f32


def test_preemption_while_speculating(target: str, draft: str, plain: LLM) -> None:
    # 24 blocks for target and draft: 8 requests that each grow to 5-6 blocks cannot all fit, so
    # some are preempted (their drafts and draft cache dropped, recomputed) while others draft.
    small = LLM(
        target,
        speculative_config={"model": draft, "num_speculative_tokens": K},
        **(COMMON | {"kv_cache_memory": 24 * BYTES_PER_BLOCK / 2**30, "max_num_seqs": 8}),
    )
    prompts = _prompts(plain, 8)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    assert results(small, prompts, params) == results(plain, prompts, params)
    assert small.llm_engine.stats.totals.preemptions > 0
    drafts, draft_tokens, accepted = spec_counts(small)
    assert drafts > 0 and 0 < accepted < draft_tokens, (drafts, draft_tokens, accepted)


def test_sampled_sequences_keep_the_target_distribution(plain: LLM, spec: LLM) -> None:
    prompt = plain.get_tokenizer().encode("The list: one, two, three")
    reference = sample_sequences(plain, prompt, 0, 400, 4)
    before = spec_counts(spec)
    got = sample_sequences(spec, prompt, 10_000, 400, 4)
    drafts, draft_tokens, accepted = _since(spec, before)
    assert drafts > 0 and 0 < accepted < draft_tokens, (drafts, draft_tokens, accepted)
    stat, df = homogeneity(reference, got)
    assert df >= 2, (reference, got)
    assert stat < chi2_critical_001(df), (stat, df, reference, got)
    # Control: accepting every draft emits the draft model's distribution, which the test sees.
    runner = spec.llm_engine.engine_core.executor.worker.model_runner
    sampler = runner.speculator.rejection_sampler
    runner.speculator.rejection_sampler = AlwaysAccept()
    try:
        stat, df = homogeneity(reference, sample_sequences(spec, prompt, 20_000, 400, 4))
    finally:
        runner.speculator.rejection_sampler = sampler
    assert stat > chi2_critical_001(df), (stat, df)


def test_a_draft_with_another_vocabulary_is_refused(
    target: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    other = save_tiny_model(tmp_path_factory.mktemp("vocab256"), hidden_size=64)  # 256 tokens
    with pytest.raises(ValueError, match=r"speculative.model=.*vocabulary has 256 tokens"):
        LLM(target, speculative_config={"model": other, "num_speculative_tokens": 2}, **COMMON)


def test_draft_cache_follows_the_accepted_tokens(target: str, draft: str) -> None:
    """The proposer against the draft model served on its own (greedy tokens, top-2 logprobs):
    two requests drafting in one batch, then one with a draft rejected and one with all its
    drafts and a bonus accepted, then both three tokens on with their first draft rejected;
    their next drafts must be the draft's continuation of the new tokens, and the probabilities
    of a sampled request's first draft the draft's top-2."""
    reference = LLM(draft, **COMMON)
    platform = platforms.current_platform  # selected by the LLM
    args = EngineArgs.from_kwargs(
        model=target,
        dtype="float32",
        max_model_len=256,
        speculative_config={"model": draft, "num_speculative_tokens": K},
    )
    config = platform.check_and_update_config(args.create_config())
    proposer = DraftModelProposer(config, torch.device("cpu"))
    proposer.load_model(None, platform)
    block_size = config.cache.block_size
    proposer.initialize_kv_cache(num_blocks=20)
    vocab_size = int(proposer.hf_config["vocab_size"])

    greedy_ids, sampled_ids = _prompts(reference, 3)[2], _prompts(reference, 2)[1]
    token_ids = np.zeros((2, 256), dtype=np.int64)
    block_table = np.zeros((2, 16), dtype=np.int32)
    block_table[0, :8], block_table[1, :8] = range(1, 9), range(9, 17)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=2, seed=3)]
    metadata = SamplingMetadata.from_params(
        params, [[], []], None, {1: make_generator(3, "cpu")}, vocab_size, "cpu"
    )

    def propose(tokens: list[list[int]]) -> list[list[int]]:
        for row, ids in enumerate(tokens):
            token_ids[row, : len(ids)] = ids
        num_tokens = np.array([len(ids) for ids in tokens])
        inputs = ProposalInputs(
            token_ids, num_tokens, [0, 1], ["g", "s"], block_table, np.array([8, 8]), metadata
        )
        return proposer.propose(inputs)

    def greedy_continuation(ids: list[int]) -> list[int]:
        out = reference.generate([ids], SamplingParams(temperature=0, max_tokens=K), use_tqdm=False)
        return out[0].outputs[0].token_ids

    def check_first_q(ids: list[int], q: torch.Tensor, first_draft: int) -> None:
        out = reference.generate(
            [ids], SamplingParams(temperature=0, max_tokens=1, logprobs=2), use_tqdm=False
        )
        top2 = out[0].outputs[0].logprobs[0]  # the draft's own top-2 logprobs, untruncated
        ids2 = sorted(t for t in top2 if top2[t].rank <= 2)
        expected = torch.tensor([top2[t].logprob for t in ids2]).exp()
        assert sorted(q.nonzero().flatten().tolist()) == ids2
        assert torch.allclose(q[ids2], expected / expected.sum(), atol=1e-4)
        assert first_draft in ids2

    tokens = [greedy_ids, sampled_ids]
    drafts = propose(tokens)
    assert drafts[0] == greedy_continuation(greedy_ids)
    q = proposer.draft_probs(["g", "s"], [K, K])
    assert q is not None and q.shape == (2 * (K + 1), vocab_size)
    check_first_q(sampled_ids, q[K + 1], drafts[1][0])
    assert torch.allclose(q[K + 1 : 2 * K + 1].sum(dim=1), torch.ones(K))
    assert not q[2 * K + 1].any()  # the bonus row

    # "g": its first draft accepted, the second rejected (another token emitted there); "s": all
    # accepted, then a bonus token.
    rejected = (drafts[0][1] + 1) % vocab_size
    tokens = [greedy_ids + [drafts[0][0], rejected], sampled_ids + drafts[1] + [drafts[1][0]]]
    drafts = propose(tokens)
    assert drafts[0] == greedy_continuation(tokens[0])
    q = proposer.draft_probs(["s"], [K])
    assert q is not None
    check_first_q(tokens[1], q[0], drafts[1][0])

    # Both three tokens on, their first draft rejected: more than one verification since the
    # proposal (the proposer reads tokens, not steps), so "at least the last token again" does
    # not cover the rejected drafts' positions: the catch-up must start at the first.
    tokens = [
        ids + [(proposed[0] + 1) % vocab_size, (proposed[1] + 1) % vocab_size, ids[-1]]
        for ids, proposed in zip(tokens, drafts, strict=True)
    ]
    drafts = propose(tokens)
    assert drafts[0] == greedy_continuation(tokens[0])
    q = proposer.draft_probs(["s"], [K])
    assert q is not None
    # The sampled request's q sees stale keys; the greedy one's argmax (mostly its last token
    # repeated) may not.
    check_first_q(tokens[1], q[0], drafts[1][0])
    assert len(tokens[0]) + K - 1 <= 8 * block_size  # the drafts' keys fit the blocks given
