"""The scheduler under pipeline parallelism: batches in flight (no model; ``FakeRunner`` plays the
last stage, which samples, and checks every step's KV slots).

The loop here is the engine core's batch queue: up to ``N`` batches are scheduled before the
oldest one's output is applied, and outputs are applied oldest first. A request in a batch in
flight is not scheduled again nor preempted; unfinished requests are split into micro-batches of
at most ``1/N`` of them; the stages that do not sample get each step's input tokens
(``CachedRequestData.new_token_ids``); an abort mid-flight drops the request's late output.
"""

from __future__ import annotations

import pathlib
import sys
from collections import deque

from kiln.config import CacheConfig, KilnConfig, ModelConfig, ParallelConfig, SchedulerConfig
from kiln.messages import SchedulerOutput
from kiln.scheduler.request import RequestStatus
from kiln.scheduler.scheduler import Scheduler
from kiln.testing.scheduler import BLOCK_SIZE, make_request

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from test_scheduler import FakeRunner, distinct_prompt  # noqa: E402


def make_pipelined_scheduler(
    pipeline_parallel_size: int = 2, num_blocks: int = 64, max_num_batched_tokens: int = 64
) -> Scheduler:
    config = KilnConfig(
        model=ModelConfig(max_model_len=256),
        cache=CacheConfig(block_size=BLOCK_SIZE),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens),
        parallel=ParallelConfig(pipeline_parallel_size=pipeline_parallel_size),
    )
    return Scheduler(config, num_blocks)


class FirstStage:
    """What a stage that does not sample knows: the prompts, then the tokens each step sends."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}

    def execute(self, so: SchedulerOutput, last_stage: FakeRunner) -> None:
        for req_id in so.finished_req_ids:
            self.tokens.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.tokens[new.req_id] = new.prompt_token_ids + new.output_token_ids
        cached = so.scheduled_cached_reqs
        assert len(cached.new_token_ids) == len(cached.req_ids)
        for req_id, start, new_tokens in zip(
            cached.req_ids, cached.num_computed_tokens, cached.new_token_ids, strict=True
        ):
            tokens = self.tokens[req_id]
            tokens[start:] = new_tokens
            # The step's input tokens, as the sampling stage has them.
            assert tokens == last_stage.tokens[req_id][: len(tokens)], req_id


def run_pipelined(scheduler: Scheduler, max_steps: int = 500) -> dict[str, list[int]]:
    """The engine core's batch queue over ``FakeRunner``; returns each request's tokens."""
    depth = scheduler.pipeline_parallel_size
    runner, first = FakeRunner(), FirstStage()
    queue: deque = deque()
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests() and not queue:
            return tokens
        if len(queue) < depth and scheduler.has_unfinished_requests():
            in_flight = set(scheduler.in_flight)
            so = scheduler.schedule()
            assert not in_flight & so.num_scheduled_tokens.keys(), "scheduled while in flight"
            for req_id in in_flight:  # a request in flight keeps its blocks
                request = scheduler.requests.get(req_id)
                assert request is None or request.status == RequestStatus.RUNNING, req_id
            if so.total_num_scheduled_tokens or so.finished_req_ids:
                first.execute(so, runner)
                queue.append((so, runner.execute(so)))
                if len(queue) < depth:
                    continue
        so, output = queue.popleft()
        for out in scheduler.update_from_output(so, output).outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    raise AssertionError("requests did not finish")


def expected(prompt: list[int], num_tokens: int) -> list[int]:
    """The tokens ``FakeRunner`` gives ``prompt`` one step at a time (its function of the
    sequence so far)."""
    runner = FakeRunner()
    tokens = list(prompt)
    for _ in range(num_tokens):
        tokens.append(runner.next_token("", tokens))
    return tokens[len(prompt) :]


def test_requests_are_split_into_micro_batches_and_not_scheduled_while_in_flight():
    scheduler = make_pipelined_scheduler()
    runner = FakeRunner()
    for i in range(4):
        scheduler.add_request(make_request(f"r{i}", distinct_prompt(i, 5), arrival_time=i))
    first = scheduler.schedule()
    second = scheduler.schedule()
    assert list(first.num_scheduled_tokens) == ["r0", "r1"]
    assert list(second.num_scheduled_tokens) == ["r2", "r3"]
    assert scheduler.schedule().num_scheduled_tokens == {}  # everyone is in flight
    outputs = scheduler.update_from_output(first, runner.execute(first)).outputs
    assert [o.request_id for o in outputs] == ["r0", "r1"]
    third = scheduler.schedule()
    assert third.num_scheduled_tokens == {"r0": 1, "r1": 1}  # back, so scheduled again
    # The stages that do not sample learn the token each request computes next.
    assert third.scheduled_cached_reqs.new_token_ids == [o.new_token_ids for o in outputs]


def test_pipelined_tokens_equal_one_batch_at_a_time_with_chunked_prefills():
    scheduler = make_pipelined_scheduler(max_num_batched_tokens=16)
    prompts = {f"r{i}": distinct_prompt(i, 3 + 7 * i) for i in range(5)}  # up to 31: chunked
    for i, (req_id, prompt) in enumerate(prompts.items()):
        scheduler.add_request(make_request(req_id, prompt, arrival_time=i, max_tokens=6))
    tokens = run_pipelined(scheduler)
    assert tokens == {req_id: expected(prompt, 6) for req_id, prompt in prompts.items()}
    assert not scheduler.in_flight


def test_preemption_never_takes_a_request_in_flight():
    # Three stages, few blocks: requests are preempted while others are in flight.
    scheduler = make_pipelined_scheduler(pipeline_parallel_size=3, num_blocks=13)
    prompts = {f"r{i}": distinct_prompt(i, 6) for i in range(6)}
    for i, (req_id, prompt) in enumerate(prompts.items()):
        scheduler.add_request(make_request(req_id, prompt, arrival_time=i, max_tokens=10))
    num_preemptions = 0
    make_stats = scheduler.make_stats

    def count_preemptions():
        nonlocal num_preemptions
        stats = make_stats()
        num_preemptions += stats.num_preemptions
        return stats

    scheduler.make_stats = count_preemptions
    tokens = run_pipelined(scheduler)
    assert num_preemptions > 0
    assert tokens == {req_id: expected(prompt, 10) for req_id, prompt in prompts.items()}


def test_a_request_aborted_in_flight_gets_no_late_output():
    scheduler = make_pipelined_scheduler()
    runner = FakeRunner()
    for i in range(2):
        scheduler.add_request(make_request(f"r{i}", distinct_prompt(i, 5), arrival_time=i))
    first = scheduler.schedule()
    assert list(first.num_scheduled_tokens) == ["r0"]
    scheduler.finish_requests("r0", RequestStatus.FINISHED_ABORTED)
    second = scheduler.schedule()
    assert list(second.num_scheduled_tokens) == ["r1"] and second.finished_req_ids == {"r0"}
    assert scheduler.update_from_output(first, runner.execute(first)).outputs == []
    outputs = scheduler.update_from_output(second, runner.execute(second)).outputs
    assert [o.request_id for o in outputs] == ["r1"]
    assert not scheduler.in_flight
    kv = scheduler.kv_cache_manager
    scheduler.finish_requests("r1", RequestStatus.FINISHED_ABORTED)
    assert kv.get_num_free_blocks() == kv.num_usable_blocks
