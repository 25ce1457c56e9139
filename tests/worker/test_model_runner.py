"""The real ``ModelRunner``, driven directly with hand-made ``SchedulerOutput``s (no scheduler, no
engine) on a small random Llama in float32, with chunked prefill: every prompt below is split over
several steps and shares each step's 16 tokens with the others. Its outputs must equal a whole
prefill's and ``transformers``': greedy tokens, seeded tokens (a partial row must not advance its
generator) and prompt logprobs gathered across chunks."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from kiln.engine.arg_utils import EngineArgs
from kiln.messages import CachedRequestData, NewRequestData, SchedulerOutput
from kiln.plugins import init_process
from kiln.sampling_params import SamplingParams
from kiln.testing.models import save_tiny_model
from kiln.worker.model_runner import ModelRunner

BUDGET = 16
"""Tokens a chunked step computes, over all its requests."""
WHOLE = 1024
"""A budget that holds every prompt at once: whole prefills."""
PROMPTS = [
    [(7 * i + 3) % 256 for i in range(37)],
    [(11 * i + 5) % 256 for i in range(23)],
    [(13 * i + 1) % 256 for i in range(29)],
    [(5 * i + 2) % 256 for i in range(18)],
]
NUM_TOKENS = 12
BLOCKS_PER_REQUEST = 4  # of 16 slots: a prompt and its tokens
LOGPROB_ATOL = 2e-3
"""Kiln and transformers, both float32, agree to ~1e-5 nats here; a position off by one or a
wrong row moves logprobs by whole nats."""


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    # Peaked logits (initializer_range=0.2): no greedy ties.
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", initializer_range=0.2)


@pytest.fixture(scope="module")
def hf_tiny(tiny_llama) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def make_runner(model: str) -> ModelRunner:
    # The lifecycle selects this process's platform (the core tests': cpu) and fills the config.
    args = EngineArgs(model=model, dtype="float32", max_model_len=256, max_num_seqs=8)
    runner = ModelRunner(init_process("offline", args.create_config()), torch.device("cpu"))
    runner.load_model()
    runner.initialize_kv_cache(1 + BLOCKS_PER_REQUEST * len(PROMPTS))  # block 0: the null block
    return runner


@dataclass
class Generated:
    token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[list[float]] = field(default_factory=list)
    """Per prompt position 1..P-1: the logprobs of [the prompt's token, then the top 2]."""
    prompt_token_ids: list[list[int]] = field(default_factory=list)
    num_chunks: int = 0


def generate(runner: ModelRunner, params: list[SamplingParams], budget: int) -> list[Generated]:
    """``PROMPTS`` with ``params`` through ``runner``, as a first-come first-served scheduler
    with ``budget`` tokens a step would send them: a running request first, each prefill chunk as
    large as the step's tokens left allow; a request's blocks are all given when it is new."""
    ids = [f"r{i}" for i in range(len(PROMPTS))]
    computed = dict.fromkeys(ids, 0)
    results = {req_id: Generated() for req_id in ids}
    known: set[str] = set()
    finished: set[str] = set()
    while len(finished) < len(ids):
        left, new, cached, num_scheduled = budget, [], CachedRequestData(), {}
        for i, req_id in enumerate(ids):
            if req_id in finished or left == 0:
                continue
            prompt = PROMPTS[i]
            n = min(left, len(prompt) - computed[req_id]) if computed[req_id] < len(prompt) else 1
            left -= n
            num_scheduled[req_id] = n
            if req_id in known:
                cached.req_ids.append(req_id)
                cached.new_block_ids.append([])
                cached.num_computed_tokens.append(computed[req_id])
            else:
                blocks = list(range(1 + BLOCKS_PER_REQUEST * i, 1 + BLOCKS_PER_REQUEST * (i + 1)))
                new.append(NewRequestData(req_id, prompt, [], params[i], blocks, 0))
                known.add(req_id)
            if computed[req_id] < len(prompt):
                results[req_id].num_chunks += 1
        step = SchedulerOutput(
            new, cached, num_scheduled, sum(num_scheduled.values()), finished_req_ids=set()
        )
        out = runner.execute_model(step)
        for req_id, n in num_scheduled.items():
            computed[req_id] += n
            result = results[req_id]
            result.token_ids += out.sampled_token_ids[out.req_id_to_index[req_id]]
            if req_id in out.prompt_logprobs_dict:
                lists = out.prompt_logprobs_dict[req_id]
                result.prompt_logprobs, result.prompt_token_ids = (
                    lists.logprobs,
                    lists.logprob_token_ids,
                )
            if len(result.token_ids) >= NUM_TOKENS:
                finished.add(req_id)
        assert all(len(results[r].token_ids) <= NUM_TOKENS for r in ids)
    # The runner drops their state when told, as the scheduler tells it the step after.
    runner.execute_model(SchedulerOutput([], CachedRequestData(), {}, 0, finished))
    assert runner.input_batch is not None and not runner.input_batch.req_id_to_index
    return [results[req_id] for req_id in ids]


@pytest.fixture(scope="module")
def runner(tiny_llama) -> ModelRunner:
    return make_runner(tiny_llama)


def test_prompts_need_several_chunks_that_share_steps(runner):
    greedy = [SamplingParams(temperature=0, max_tokens=NUM_TOKENS)] * len(PROMPTS)
    assert all(len(p) > BUDGET for p in PROMPTS)
    assert sum(len(p) for p in PROMPTS) > 4 * BUDGET
    chunked = generate(runner, greedy, BUDGET)
    assert all(g.num_chunks >= 2 for g in chunked)
    whole = generate(runner, greedy, WHOLE)
    assert [g.num_chunks for g in whole] == [1] * len(PROMPTS)


def test_greedy_and_prompt_logprobs_match_whole_prefill_and_transformers(runner, hf_tiny, hf_ref):
    params = [SamplingParams(temperature=0, max_tokens=NUM_TOKENS, prompt_logprobs=2)] * len(
        PROMPTS
    )
    chunked = generate(runner, params, BUDGET)
    whole = generate(runner, params, WHOLE)
    for prompt, got, base in zip(PROMPTS, chunked, whole, strict=True):
        expected = hf_ref.greedy(hf_tiny, prompt, NUM_TOKENS)
        reference = hf_ref.logprobs(hf_tiny, prompt)
        assert got.token_ids == expected
        assert base.token_ids == expected
        assert len(got.prompt_logprobs) == len(prompt) - 1
        for p in range(1, len(prompt)):
            token_ids, logprobs = got.prompt_token_ids[p - 1], got.prompt_logprobs[p - 1]
            top = reference[p - 1].topk(2).indices.tolist()
            assert token_ids == [prompt[p], *top], f"prompt position {p}"
            want = reference[p - 1, token_ids].tolist()
            assert logprobs == pytest.approx(want, abs=LOGPROB_ATOL), f"prompt position {p}"
        assert got.prompt_token_ids == base.prompt_token_ids
        for row, base_row in zip(got.prompt_logprobs, base.prompt_logprobs, strict=True):
            assert row == pytest.approx(base_row, abs=1e-5)


def test_seeded_sampling_matches_whole_prefill(runner):
    params = [
        SamplingParams(temperature=1.0, seed=100 + i, max_tokens=NUM_TOKENS)
        for i in range(len(PROMPTS))
    ]
    chunked = generate(runner, params, BUDGET)
    whole = generate(runner, params, WHOLE)
    assert [g.token_ids for g in chunked] == [g.token_ids for g in whole]
    # Seeds matter: other seeds give another text for at least one prompt.
    other = [SamplingParams(temperature=1.0, seed=7 + i, max_tokens=NUM_TOKENS) for i in range(4)]
    assert [g.token_ids for g in generate(runner, other, BUDGET)] != [g.token_ids for g in whole]
