"""Scheduler: budgets, chunked prefill, prefix hits, preemption, aborts, stops, priority, stats.

No model: ``FakeRunner`` plays the model runner. It keeps its own per-request state from the
``SchedulerOutput``s alone (as a real runner must), simulates the KV cache as one token id per slot,
and checks after every step that every live request's computed tokens are really in its blocks, so
a wrong prefix hit, a block reused while held or a stale block table fails the test.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kiln.messages import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    EngineCoreOutput,
    FinishReason,
    LogprobsLists,
    ModelRunnerOutput,
    SchedulerOutput,
)
from kiln.scheduler.kv_cache import NULL_BLOCK_ID
from kiln.scheduler.request import RequestStatus
from kiln.scheduler.scheduler import Scheduler
from kiln.testing.scheduler import BLOCK_SIZE, make_request, make_scheduler
from kiln.testing.scheduler import EOS_TOKEN_ID as EOS


def distinct_prompt(i: int, length: int) -> list[int]:
    """A prompt that shares no block with another ``i``'s (so no prefix hits)."""
    return [1000 * (i + 1) + j for j in range(length)]


def default_token(request_id: str, tokens: list[int]) -> int:
    """Deterministic and never EOS: the same sequence gives the same next token."""
    return 100 + (sum(tokens[-3:]) + len(tokens)) % 50


class FakeRunner:
    def __init__(self, next_token: Callable[[str, list[int]], int] = default_token) -> None:
        self.next_token = next_token
        self.kv: dict[tuple[int, int], int] = {}  # (block id, offset) -> token id
        self.tokens: dict[str, list[int]] = {}
        self.block_ids: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}
        self.logprobs: dict[str, LogprobsLists] = {}
        self.prompt_logprobs: dict[str, LogprobsLists] = {}

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in so.finished_req_ids:
            for state in (self.tokens, self.block_ids, self.num_computed):
                state.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.tokens, "resumed before its old state was dropped"
            self.tokens[new.req_id] = new.prompt_token_ids + new.output_token_ids
            self.block_ids[new.req_id] = list(new.block_ids)
            self.num_computed[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for req_id, new_block_ids, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            assert self.num_computed[req_id] == num_computed
            self.block_ids[req_id].extend(new_block_ids)
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        # Write every scheduled token's KV first (as attention backends do), then read.
        for req_id, num_tokens in so.num_scheduled_tokens.items():
            start = self.num_computed[req_id]
            assert 0 < num_tokens and start + num_tokens <= len(self.tokens[req_id])
            assert len(self.block_ids[req_id]) * BLOCK_SIZE >= start + num_tokens
            for pos in range(start, start + num_tokens):
                self.kv[self._slot(req_id, pos)] = self.tokens[req_id][pos]
            self.num_computed[req_id] += num_tokens
        self.check_kv()
        req_ids = list(so.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for req_id in req_ids:
            tokens = self.tokens[req_id]
            if self.num_computed[req_id] < len(tokens):
                sampled.append([])
            else:
                tokens.append(self.next_token(req_id, tokens))
                sampled.append([tokens[-1]])
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            logprobs=self.logprobs,
            prompt_logprobs_dict=self.prompt_logprobs,
        )

    def check_kv(self) -> None:
        for req_id, num_computed in self.num_computed.items():
            for pos in range(num_computed):
                assert self.kv[self._slot(req_id, pos)] == self.tokens[req_id][pos], (req_id, pos)

    def _slot(self, req_id: str, pos: int) -> tuple[int, int]:
        block_id = self.block_ids[req_id][pos // BLOCK_SIZE]
        assert block_id != NULL_BLOCK_ID
        return block_id, pos % BLOCK_SIZE


def step(
    scheduler: Scheduler, runner: FakeRunner
) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    so = scheduler.schedule()
    engine_outputs = scheduler.update_from_output(so, runner.execute(so))
    return so, engine_outputs.outputs


def run_all(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 500):
    """Step until no request is left; returns ({id: tokens}, {id: finished output}, outputs)."""
    tokens: dict[str, list[int]] = {}
    finished: dict[str, EngineCoreOutput] = {}
    schedule_outputs = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        so, outputs = step(scheduler, runner)
        schedule_outputs.append(so)
        for out in outputs:
            assert out.request_id not in finished
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finished[out.request_id] = out
    else:
        raise AssertionError("requests did not finish")
    kv = scheduler.kv_cache_manager
    assert kv.get_num_free_blocks() == kv.num_usable_blocks and kv.usage == 0.0
    return tokens, finished, schedule_outputs


def expected_tokens(prompt_len: int, num_tokens: int) -> list[int]:
    tokens = [10 + (i % 7) for i in range(prompt_len)]
    for _ in range(num_tokens):
        tokens.append(default_token("", tokens))
    return tokens[prompt_len:]


# -- budgets ---------------------------------------------------------------------------------------


def test_budget_and_max_num_seqs_with_running_requests_first():
    scheduler = make_scheduler(max_num_seqs=3, max_num_batched_tokens=20)
    runner = FakeRunner()
    for i in range(5):
        scheduler.add_request(make_request(f"r{i}", distinct_prompt(i, 8), arrival_time=i))
    so, outputs = step(scheduler, runner)
    assert so.num_scheduled_tokens == {"r0": 8, "r1": 8, "r2": 4}  # r2 chunked, r3 over max seqs
    assert [o.request_id for o in outputs] == ["r0", "r1"]
    assert scheduler.get_request_counts() == (3, 2)
    so, outputs = step(scheduler, runner)
    assert so.num_scheduled_tokens == {"r0": 1, "r1": 1, "r2": 4}
    assert so.scheduled_cached_reqs.req_ids == ["r0", "r1", "r2"] and not so.scheduled_new_reqs
    assert so.scheduled_cached_reqs.num_computed_tokens == [8, 8, 4]
    assert [o.request_id for o in outputs] == ["r0", "r1", "r2"]
    tokens, finished, sos = run_all(scheduler, runner)
    assert all(len(sched.num_scheduled_tokens) <= 3 for sched in sos)
    assert all(sched.total_num_scheduled_tokens <= 20 for sched in sos)
    assert [len(tokens[f"r{i}"]) for i in range(5)] == [2, 2, 3, 4, 4] and len(finished) == 5


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room():
    scheduler = make_scheduler(max_num_batched_tokens=20, enable_chunked_prefill=False)
    runner = FakeRunner()
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", distinct_prompt(i, 8), arrival_time=i))
    so, _ = step(scheduler, runner)
    assert so.num_scheduled_tokens == {"r0": 8, "r1": 8}
    so, _ = step(scheduler, runner)
    assert so.num_scheduled_tokens == {"r0": 1, "r1": 1, "r2": 8}


def test_chunked_prefill_of_a_long_prompt():
    scheduler = make_scheduler(max_num_batched_tokens=16)
    runner = FakeRunner()
    scheduler.add_request(make_request("long", 50, max_tokens=3))
    chunks, computed = [], []
    for _ in range(4):
        so, outputs = step(scheduler, runner)
        chunks.append(so.num_scheduled_tokens["long"])
        reqs = so.scheduled_new_reqs or so.scheduled_cached_reqs
        computed.append(
            reqs[0].num_computed_tokens if so.scheduled_new_reqs else reqs.num_computed_tokens[0]
        )
        assert (outputs != []) == (len(chunks) == 4)  # No token before the last chunk.
    assert chunks == [16, 16, 16, 2] and computed == [0, 16, 32, 48]
    tokens, finished, _ = run_all(scheduler, runner)
    assert len(tokens["long"]) == 2  # One came with the last chunk.


def test_prompt_longer_than_the_budget_is_split_even_without_chunked_prefill():
    scheduler = make_scheduler(max_num_batched_tokens=16, enable_chunked_prefill=False)
    runner = FakeRunner()
    scheduler.add_request(make_request("long", 40, max_tokens=2))
    tokens, finished, sos = run_all(scheduler, runner)
    assert [so.total_num_scheduled_tokens for so in sos] == [16, 16, 8, 1]
    assert tokens["long"] == expected_tokens(40, 2)


# -- prefix caching --------------------------------------------------------------------------------


def test_prefix_hit_skips_cached_blocks_but_never_the_whole_prompt():
    scheduler = make_scheduler()
    runner = FakeRunner()
    prompt = list(range(20, 40))  # 20 tokens: 5 full blocks.
    scheduler.add_request(make_request("a", prompt))
    run_all(scheduler, runner)
    scheduler.add_request(make_request("same", prompt))
    scheduler.add_request(make_request("branch", prompt[:10] + [7, 7, 7], arrival_time=1))
    so, outputs = step(scheduler, runner)
    new = {r.req_id: r for r in so.scheduled_new_reqs}
    assert new["same"].num_computed_tokens == 16  # Not 20: the last token is recomputed.
    assert new["branch"].num_computed_tokens == 8
    assert so.num_scheduled_tokens == {"same": 4, "branch": 5}
    assert {o.request_id: o.num_cached_tokens for o in outputs} == {"same": 16, "branch": 8}
    stats = scheduler.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (0, 0)  # Taken by the step.
    run_all(scheduler, runner)


def test_requests_added_together_share_blocks_in_the_same_step():
    scheduler = make_scheduler()
    runner = FakeRunner()
    prompt = list(range(30, 43))
    scheduler.add_request(make_request("a", prompt))
    scheduler.add_request(make_request("b", prompt, arrival_time=1))
    so = scheduler.schedule()
    # b reads a's blocks as a writes them: the runner checks b's cached tokens are there.
    assert so.num_scheduled_tokens == {"a": 13, "b": 1}
    engine_outputs = scheduler.update_from_output(so, runner.execute(so))
    stats = engine_outputs.scheduler_stats
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (26, 12)
    first = {o.request_id: o.new_token_ids for o in engine_outputs.outputs}
    tokens, _, _ = run_all(scheduler, runner)
    assert first["a"] + tokens["a"] == first["b"] + tokens["b"]


def test_resumed_or_cached_outputs_are_correct_with_and_without_caching():
    results = []
    for caching in (True, False):
        scheduler = make_scheduler(enable_prefix_caching=caching)
        runner = FakeRunner()
        for i in range(4):
            scheduler.add_request(make_request(f"r{i}", 9, max_tokens=6, arrival_time=i))
        tokens, _, _ = run_all(scheduler, runner)
        results.append(tokens)
    assert results[0] == results[1]
    assert results[0]["r0"] == expected_tokens(9, 6)


# -- preemption ------------------------------------------------------------------------------------


@pytest.mark.parametrize("caching", [True, False])
def test_preemption_when_blocks_run_out(caching):
    # 6 usable blocks (24 slots); three requests that each grow to 4 blocks.
    scheduler = make_scheduler(num_blocks=7, enable_prefix_caching=caching)
    runner = FakeRunner()
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", 4, max_tokens=10, arrival_time=i))
    preempted_order = []
    num_preemptions = 0
    tokens: dict[str, list[int]] = {}
    for _ in range(200):
        if not scheduler.has_unfinished_requests():
            break
        so = scheduler.schedule()
        out = scheduler.update_from_output(so, runner.execute(so))
        preempted_order += [
            r.request_id for r in scheduler.waiting if r.status == RequestStatus.PREEMPTED
        ]
        num_preemptions += out.scheduler_stats.num_preemptions
        for o in out.outputs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert not scheduler.has_unfinished_requests()
    assert num_preemptions >= 1
    assert preempted_order[0] == "r2"  # The latest arrival goes first.
    for i in range(3):
        assert tokens[f"r{i}"] == expected_tokens(4, 10)
    kv = scheduler.kv_cache_manager
    assert kv.get_num_free_blocks() == kv.num_usable_blocks


def test_preempted_request_is_resumed_with_full_data():
    scheduler = make_scheduler(num_blocks=4)  # 3 usable blocks.
    runner = FakeRunner()
    scheduler.add_request(make_request("old", 4, max_tokens=8, arrival_time=0))
    scheduler.add_request(make_request("new", 4, max_tokens=2, arrival_time=1))
    preempted_step = None
    finished_early = []
    for n in range(30):
        so, outputs = step(scheduler, runner)
        finished_early += [o for o in outputs if o.finished]
        if "new" in so.finished_req_ids and preempted_step is None:
            preempted_step = n
            assert scheduler.requests["new"].status == RequestStatus.PREEMPTED
            assert "new" not in so.num_scheduled_tokens
        resumed = [r for r in so.scheduled_new_reqs if r.req_id == "new"]
        if preempted_step is not None and resumed:
            assert resumed[0].output_token_ids and len(resumed[0].block_ids) >= 1
            break
    else:
        raise AssertionError("'new' was not preempted and resumed")
    tokens, finished, _ = run_all(scheduler, runner)
    finished.update((o.request_id, o) for o in finished_early)
    assert finished["new"].finish_reason == FinishReason.LENGTH
    assert finished["old"].finish_reason == FinishReason.LENGTH


# -- aborts and oversized requests -------------------------------------------------------------


def test_abort_waiting_and_running_requests_frees_every_block():
    scheduler = make_scheduler(max_num_seqs=2)
    runner = FakeRunner()
    for i in range(4):
        scheduler.add_request(make_request(f"r{i}", 10, max_tokens=20, arrival_time=i))
    so = scheduler.schedule()
    scheduler.finish_requests(["r1", "r3", "unknown"], RequestStatus.FINISHED_ABORTED)
    # r1 was aborted while its step ran: it gets no output.
    outputs = scheduler.update_from_output(so, runner.execute(so)).outputs
    assert [o.request_id for o in outputs] == ["r0"]
    scheduler.finish_requests("r1", RequestStatus.FINISHED_ABORTED)  # Idempotent.
    assert scheduler.get_request_counts() == (1, 1) and scheduler.get_num_unfinished_requests() == 2
    so, _ = step(scheduler, runner)
    assert {"r1", "r3"} <= so.finished_req_ids and "r2" in so.num_scheduled_tokens
    scheduler.finish_requests(["r0", "r2"], RequestStatus.FINISHED_ABORTED)
    kv = scheduler.kv_cache_manager
    assert kv.get_num_free_blocks() == kv.num_usable_blocks
    assert not scheduler.has_unfinished_requests()
    assert scheduler.schedule().finished_req_ids == {"r0", "r2"}


def test_a_request_the_step_failed_finishes_with_an_error_and_shares_no_block():
    """``ModelRunnerOutput.failed_requests`` (its LoRA adapter would not load): that request
    finishes with finish reason "error" and the message; the others go on, and the blocks the
    failed step computed for it leave the prefix cache."""
    scheduler = make_scheduler()
    runner = FakeRunner()
    for i in range(2):
        scheduler.add_request(make_request(f"r{i}", distinct_prompt(i, 12), max_tokens=3))
    so = scheduler.schedule()
    output = runner.execute(so)
    output.failed_requests = {"r0": "adapter 'x' failed to load"}
    outputs = {o.request_id: o for o in scheduler.update_from_output(so, output).outputs}
    failed = outputs["r0"]
    assert failed.finish_reason == FinishReason.ERROR and failed.new_token_ids == []
    assert failed.stop_reason == "adapter 'x' failed to load"
    assert outputs["r1"].new_token_ids and not outputs["r1"].finished
    assert scheduler.get_request_counts() == (1, 0)
    kv = scheduler.kv_cache_manager
    assert kv.get_computed_blocks(make_request("again", distinct_prompt(0, 12))).blocks == []
    assert len(kv.get_computed_blocks(make_request("same", distinct_prompt(1, 12))).blocks) == 2
    tokens, finished, _ = run_all(scheduler, runner)
    assert finished["r1"].finish_reason == FinishReason.LENGTH and len(tokens["r1"]) == 2


def test_request_too_large_is_ignored_without_blocking_others():
    scheduler = make_scheduler(max_model_len=32)
    runner = FakeRunner()
    scheduler.add_request(make_request("huge", 32))
    scheduler.add_request(make_request("ok", 8))
    assert scheduler.has_unfinished_requests() and scheduler.get_num_unfinished_requests() == 2
    tokens, finished, _ = run_all(scheduler, runner)
    assert finished["huge"].finish_reason == FinishReason.LENGTH and tokens["huge"] == []
    assert len(tokens["ok"]) == 4
    # Bigger than the whole cache (3 usable blocks = 12 slots), with no max_model_len.
    scheduler = make_scheduler(num_blocks=4, max_model_len=None)
    scheduler.add_request(make_request("huge", 12))
    scheduler.add_request(make_request("ok", 4, max_tokens=3))
    assert scheduler.max_model_len == 12
    tokens, finished, _ = run_all(scheduler, FakeRunner())
    assert finished["huge"].finish_reason == FinishReason.LENGTH
    assert len(tokens["ok"]) == 3
    # Only an ignored request: the engine still steps once to report it.
    scheduler = make_scheduler(max_model_len=16)
    scheduler.add_request(make_request("huge", 20))
    so = scheduler.schedule()
    assert so.total_num_scheduled_tokens == 0
    outputs = scheduler.update_from_output(so, EMPTY_MODEL_RUNNER_OUTPUT).outputs
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("huge", FinishReason.LENGTH)]
    assert not scheduler.has_unfinished_requests()


def test_the_cache_capacity_caps_max_model_len():
    # 3 usable blocks = 12 slots, though the model allows 256 tokens.
    scheduler = make_scheduler(num_blocks=4, max_model_len=256)
    assert scheduler.max_model_len == 12
    scheduler.add_request(make_request("huge", 12))
    scheduler.add_request(make_request("grows", 4, max_tokens=None))
    tokens, finished, _ = run_all(scheduler, FakeRunner())
    assert finished["huge"].finish_reason == FinishReason.LENGTH and tokens["huge"] == []
    # Alone, it grows to the whole cache instead of preempting itself forever.
    assert len(tokens["grows"]) == 8 and finished["grows"].finish_reason == FinishReason.LENGTH


def test_context_length_caps_generation():
    scheduler = make_scheduler(max_model_len=12)
    scheduler.add_request(make_request("r", 8, max_tokens=None))
    tokens, finished, _ = run_all(scheduler, FakeRunner())
    assert len(tokens["r"]) == 4 and finished["r"].finish_reason == FinishReason.LENGTH


def test_add_request_rejects_bad_input():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 4))
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(make_request("a", 4))
    with pytest.raises(ValueError, match="empty prompt"):
        scheduler.add_request(make_request("b", []))


# -- stops -----------------------------------------------------------------------------------------


def scripted(script: list[int]) -> Callable[[str, list[int]], int]:
    position = {}

    def next_token(req_id: str, tokens: list[int]) -> int:
        i = position.get(req_id, 0)
        position[req_id] = i + 1
        return script[i] if i < len(script) else 50

    return next_token


@pytest.mark.parametrize(
    "params, expected, reason, stop_reason",
    [
        ({}, [5, EOS], FinishReason.STOP, None),
        ({"min_tokens": 3}, [5, EOS, 6, EOS], FinishReason.STOP, None),
        ({"ignore_eos": True}, [5, EOS, 6, EOS, 9, 9], FinishReason.LENGTH, None),
        ({"stop_token_ids": [6]}, [5, EOS], FinishReason.STOP, None),
        ({"ignore_eos": True, "stop_token_ids": [6]}, [5, EOS, 6], FinishReason.STOP, 6),
        ({"ignore_eos": True, "min_tokens": 4, "stop_token_ids": [6]}, None, None, None),
        ({"ignore_eos": True, "max_tokens": 2}, [5, EOS], FinishReason.LENGTH, None),
    ],
)
def test_stop_conditions(params, expected, reason, stop_reason):
    params.setdefault("max_tokens", 6)
    if expected is None:  # min_tokens holds the stop token back until the 4th token.
        expected, reason = [5, EOS, 6, EOS, 9, 9], FinishReason.LENGTH
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", 5, **params))
    tokens, finished, _ = run_all(scheduler, FakeRunner(scripted([5, EOS, 6, EOS, 9, 9, 9])))
    assert tokens["r"] == expected
    assert finished["r"].finish_reason == reason and finished["r"].stop_reason == stop_reason


def test_eos_wins_over_max_tokens_on_the_same_token():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", 5, max_tokens=2))
    _, finished, _ = run_all(scheduler, FakeRunner(scripted([5, EOS])))
    assert finished["r"].finish_reason == FinishReason.STOP


# -- priority --------------------------------------------------------------------------------------


def test_priority_orders_admission_and_preemption():
    scheduler = make_scheduler(max_num_seqs=1)
    runner = FakeRunner()
    scheduler.add_request(make_request("low", 4, priority=5, arrival_time=0))
    scheduler.add_request(make_request("late", 4, priority=0, arrival_time=2))
    scheduler.add_request(make_request("high", 4, priority=-1, arrival_time=3))
    scheduler.add_request(make_request("early", 4, priority=0, arrival_time=1))
    order = []
    for _ in range(40):
        so, _ = step(scheduler, runner)
        order += [r.req_id for r in so.scheduled_new_reqs]
        if not scheduler.has_unfinished_requests():
            break
    assert order == ["high", "early", "late", "low"]
    # Preemption takes the lowest priority, even when it arrived first.
    scheduler = make_scheduler(num_blocks=5)  # 4 usable blocks.
    scheduler.add_request(make_request("first_low", 4, priority=1, max_tokens=8, arrival_time=0))
    scheduler.add_request(make_request("later_high", 4, priority=0, max_tokens=8, arrival_time=1))
    runner = FakeRunner()
    while True:
        so, _ = step(scheduler, runner)
        if so.finished_req_ids:
            assert so.finished_req_ids == {"first_low"}
            break
    tokens, _, _ = run_all(scheduler, runner)


# -- outputs and stats -----------------------------------------------------------------------------


def test_the_runners_logprobs_are_routed_and_prompt_logprobs_only_with_the_first_token():
    scheduler = make_scheduler(max_num_batched_tokens=6)
    runner = FakeRunner()
    scheduler.add_request(make_request("r", 9, max_tokens=3, logprobs=1, prompt_logprobs=1))
    _, outputs = step(scheduler, runner)  # First chunk: 6 tokens, no output.
    assert outputs == []
    row = LogprobsLists([[7, 8]], [[-0.5, -1.0]], [1])
    prompt = LogprobsLists([[1, 2]] * 8, [[-1.0, -2.0]] * 8, [1] * 8)
    # The fake runner sends them every step, as a runner recomputing a preempted prefill would.
    runner.logprobs, runner.prompt_logprobs = {"r": row}, {"r": prompt}
    outputs = {o.request_id: o for o in step(scheduler, runner)[1]}
    assert outputs["r"].new_prompt_logprobs is prompt and outputs["r"].new_logprobs is row
    outputs = {o.request_id: o for o in step(scheduler, runner)[1]}
    assert outputs["r"].new_prompt_logprobs is None and outputs["r"].new_logprobs is row


def test_stats():
    scheduler = make_scheduler(num_blocks=11, max_num_seqs=2)
    runner = FakeRunner()
    prompt = list(range(50, 59))  # 9 tokens: 3 blocks
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", prompt, max_tokens=3, arrival_time=i))
    so = scheduler.schedule()
    stats = scheduler.update_from_output(so, runner.execute(so)).scheduler_stats
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (2, 1)
    assert stats.kv_cache_usage == pytest.approx(4 / 10)  # r1 shares r0's 2 full blocks.
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (18, 8)
    assert stats.num_preemptions == 0
    stats = scheduler.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (0, 0)
    run_all(scheduler, runner)
    stats = scheduler.make_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage) == (0, 0, 0.0)


def test_scheduler_matches_its_interface():
    from kiln.plugins.interfaces import check_implements
    from kiln.scheduler.interface import SchedulerInterface

    check_implements(Scheduler, SchedulerInterface)
