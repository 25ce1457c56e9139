"""The scheduler's side of speculation, with hand-made runner outputs: drafts are scheduled as
``1 + k`` tokens with KV slots, cut to the budget, the context and ``max_tokens``; rejected
drafts are taken back from ``num_computed_tokens``; a stop inside the run cuts tokens and
logprobs; preemption drops drafts; the counters reach the stats."""

from __future__ import annotations

from kiln.config import SpeculativeConfig
from kiln.messages import LogprobsLists, ModelRunnerOutput, SchedulerOutput
from kiln.sampling_params import SamplingParams
from kiln.scheduler.request import Request
from kiln.scheduler.scheduler import Scheduler
from kiln.testing.scheduler import BLOCK_SIZE, make_scheduler

# A 64-token context: drafts are cut to it.
MAX_MODEL_LEN = 64


def output(
    scheduler_output: SchedulerOutput,
    tokens: dict[str, list[int]],
    drafts: dict[str, list[int]] | None = None,
    logprobs: dict[str, LogprobsLists] | None = None,
) -> ModelRunnerOutput:
    req_ids = list(scheduler_output.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[tokens.get(r, []) for r in req_ids],
        logprobs=logprobs or {},
        spec_token_ids=[(drafts or {}).get(r, []) for r in req_ids],
    )


def start(scheduler: Scheduler, request: Request, drafts: list[int]) -> None:
    """Prefill ``request`` and have the runner propose ``drafts``."""
    scheduler.add_request(request)
    out = scheduler.schedule()
    scheduler.update_from_output(out, output(out, {request.request_id: [50]}, {"r": drafts}))


def test_drafts_are_scheduled_verified_and_counted() -> None:
    scheduler = make_scheduler(max_model_len=MAX_MODEL_LEN)
    request = Request("r", list(range(10, 16)), SamplingParams(max_tokens=20), eos_token_id=2)
    start(scheduler, request, [51, 52, 53])
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"r": 4}
    assert out.scheduled_spec_decode_tokens == {"r": [51, 52, 53]}
    # 6 prompt + 1 output + 3 drafts = 10 slots -> 3 blocks of 4.
    assert len(scheduler.kv_cache_manager.get_block_ids("r")) == 3
    # Two drafts accepted, then the model's own token: 3 new tokens, one draft rejected.
    engine_outputs = scheduler.update_from_output(out, output(out, {"r": [51, 52, 60]}))
    assert engine_outputs.outputs[0].new_token_ids == [51, 52, 60]
    assert request.num_tokens == 10 and request.num_computed_tokens == 9
    stats = engine_outputs.scheduler_stats
    assert (stats.spec_num_drafts, stats.spec_num_draft_tokens) == (1, 3)
    assert stats.spec_num_accepted_tokens == 2
    # No drafts proposed: a plain decode of 1 token.
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"r": 1} and not out.scheduled_spec_decode_tokens


def test_a_draft_model_gets_lookahead_slots_within_the_context() -> None:
    draft_model = SpeculativeConfig("draft_model", 3, model="draft.gguf")
    scheduler = make_scheduler(max_model_len=MAX_MODEL_LEN, speculative=draft_model)
    request = Request("r", list(range(10, 16)), SamplingParams(max_tokens=60), eos_token_id=2)
    scheduler.add_request(request)
    out = scheduler.schedule()
    # 6 prompt tokens and 3 slots for the draft's keys after them: 3 blocks of 4 (2 without).
    assert out.scheduled_new_reqs[0].block_ids == [1, 2, 3]
    scheduler.update_from_output(out, output(out, {"r": [50]}, {"r": [51, 52, 53]}))
    out = scheduler.schedule()
    # 6 + 1 + 3 drafts, then 3 lookahead slots: 13 -> 4 blocks.
    assert len(scheduler.kv_cache_manager.get_block_ids("r")) == 4
    # Near the end of the context the lookahead stops there (the block table ends there).
    scheduler = make_scheduler(max_model_len=MAX_MODEL_LEN, speculative=draft_model)
    request = Request("r", list(range(10, 72)), SamplingParams(max_tokens=60), eos_token_id=2)
    scheduler.add_request(request)
    scheduler.schedule()
    assert len(scheduler.kv_cache_manager.get_block_ids("r")) == 64 // BLOCK_SIZE


def test_drafts_are_cut_to_max_tokens_and_the_budget() -> None:
    scheduler = make_scheduler(max_model_len=MAX_MODEL_LEN)
    request = Request("r", list(range(10, 16)), SamplingParams(max_tokens=3), eos_token_id=2)
    start(scheduler, request, [51, 52, 53, 54])
    out = scheduler.schedule()
    # 1 output so far, max_tokens 3: at most 1 draft + the bonus token.
    assert out.scheduled_spec_decode_tokens == {"r": [51]}
    scheduler = make_scheduler(max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=3)
    request = Request("r", [10, 11, 12], SamplingParams(max_tokens=20), eos_token_id=2)
    start(scheduler, request, [51, 52, 53, 54])
    out = scheduler.schedule()
    assert out.scheduled_spec_decode_tokens == {"r": [51, 52]}
    assert out.num_scheduled_tokens == {"r": 3}


def test_a_stop_inside_the_run_cuts_tokens_and_logprobs() -> None:
    scheduler = make_scheduler(max_model_len=MAX_MODEL_LEN)
    params = SamplingParams(max_tokens=20, stop_token_ids=[52], logprobs=0)
    request = Request("r", list(range(10, 16)), params, eos_token_id=2)
    start(scheduler, request, [51, 52, 53])
    out = scheduler.schedule()
    rows = LogprobsLists([[51], [52], [53], [54]], [[-0.1], [-0.2], [-0.3], [-0.4]], [1, 1, 1, 1])
    engine_outputs = scheduler.update_from_output(
        out, output(out, {"r": [51, 52, 53, 54]}, logprobs={"r": rows})
    )
    (result,) = engine_outputs.outputs
    assert result.new_token_ids == [51, 52] and result.finished
    assert result.new_logprobs is not None and result.new_logprobs.logprobs == [[-0.1], [-0.2]]
    assert "r" not in scheduler.requests


def test_preemption_drops_the_drafts() -> None:
    scheduler = make_scheduler(max_model_len=MAX_MODEL_LEN)
    request = Request("r", list(range(10, 21)), SamplingParams(max_tokens=20), eos_token_id=2)
    start(scheduler, request, [51, 52, 53, 54])
    scheduler.running.remove(request)  # what running out of blocks does
    scheduler._preempt(request)
    assert request.spec_token_ids == []
    out = scheduler.schedule()
    assert not out.scheduled_spec_decode_tokens
    assert [new.req_id for new in out.scheduled_new_reqs] == ["r"]
