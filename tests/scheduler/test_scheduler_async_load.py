"""Asynchronous KV loads in the scheduler, no model: the P2P connector's scheduler side (a
decode instance) against ``RemoteRunner``, a ``FakeRunner`` whose pulls arrive a few steps
after they start. Its KV cache holds token ids, so a request that runs before its blocks are
loaded, or from blocks that failed to load, fails ``check_kv`` at once.

The worker side (sockets, tensors) and a real model are tested in ``tests/kv_transfer``.
"""

from __future__ import annotations

import pathlib
import sys

from kiln.config import KVTransferConfig
from kiln.kv_transfer.p2p import P2pMetadata
from kiln.kv_transfer.params import prompt_hash
from kiln.messages import FinishReason, KVConnectorOutput, ModelRunnerOutput, SchedulerOutput
from kiln.scheduler.request import RequestStatus
from kiln.scheduler.scheduler import Scheduler
from kiln.testing.scheduler import BLOCK_SIZE, make_request, make_scheduler

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from test_scheduler import FakeRunner, distinct_prompt, run_all, step  # noqa: E402


def consumer(policy: str = "recompute") -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="P2pConnector", kv_role="kv_consumer", kv_load_failure_policy=policy
    )


def remote(prompt: list[int]) -> dict:
    """``kv_transfer_params`` as a prefill instance answers them for ``prompt``."""
    num_blocks = -(-len(prompt) // BLOCK_SIZE)
    return {
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "remote_host": "127.0.0.1",
            "remote_port": 1,
            "remote_request_id": "prefill-1",
            "remote_block_ids": list(range(100, 100 + num_blocks)),
            "remote_num_tokens": len(prompt),
            "remote_prompt_hash": prompt_hash(prompt),
        }
    }


class RemoteRunner(FakeRunner):
    """``FakeRunner`` plus pulls that take ``delay`` steps; ``fail`` pulls report their blocks
    as load errors, the others write the right token ids into them."""

    def __init__(self, delay: int = 3, fail: bool = False) -> None:
        super().__init__()
        self.delay, self.fail = delay, fail
        self.pulls: dict[str, tuple[int, list[int], list[int]]] = {}
        """Request id -> (steps left, its block ids, its prompt)."""
        self.prompts: dict[str, list[int]] = {}
        self.cancelled: list[str] = []

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        metadata: P2pMetadata | None = so.kv_connector_metadata
        report = KVConnectorOutput()
        if metadata is not None:
            self.cancelled += metadata.cancels
            for req_id in metadata.cancels:
                self.pulls.pop(req_id, None)
            for req_id, load in metadata.loads.items():
                self.pulls[req_id] = (self.delay, load.block_ids, self.prompts[req_id])
        for req_id, (left, block_ids, prompt) in list(self.pulls.items()):
            if left > 0:
                self.pulls[req_id] = (left - 1, block_ids, prompt)
                continue
            del self.pulls[req_id]
            report.finished_recving.add(req_id)
            if self.fail:
                report.invalid_block_ids.update(block_ids)
                continue
            # The prompts here have no local hit: the pull fills the request's first blocks.
            for i, block_id in enumerate(block_ids):
                for offset in range(BLOCK_SIZE):
                    self.kv[(block_id, offset)] = prompt[i * BLOCK_SIZE + offset]
        if so.total_num_scheduled_tokens:
            output = super().execute(so)
        else:
            output = ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
        output.kv_connector_output = report
        return output


def add(scheduler: Scheduler, runner: RemoteRunner, req_id: str, prompt: list[int], **params):
    runner.prompts[req_id] = prompt
    scheduler.add_request(make_request(req_id, prompt, extra_args=remote(prompt), **params))


def test_a_loading_request_waits_while_others_run_then_starts_at_its_last_token():
    scheduler = make_scheduler(64, kv_transfer=consumer())
    runner = RemoteRunner(delay=3)
    prompt = distinct_prompt(0, 4 * BLOCK_SIZE + 2)  # ends mid-block
    add(scheduler, runner, "remote", prompt)
    scheduler.add_request(make_request("local", distinct_prompt(1, 10), max_tokens=6))
    so, _ = step(scheduler, runner)
    assert list(so.num_scheduled_tokens) == ["local"]  # the other one loads meanwhile
    assert scheduler.requests["remote"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert scheduler.get_request_counts() == (1, 1)
    for _ in range(3):
        so, _ = step(scheduler, runner)
        assert "remote" not in so.num_scheduled_tokens
    so, outputs = step(scheduler, runner)
    # The 4 whole blocks came from the remote; only the 2 tokens after them are computed.
    assert so.num_scheduled_tokens["remote"] == 2
    assert [r.req_id for r in so.scheduled_new_reqs] == ["remote"]
    assert so.scheduled_new_reqs[0].num_computed_tokens == 4 * BLOCK_SIZE
    first = [o.new_token_ids for o in outputs if o.request_id == "remote"]
    tokens, finished, _ = run_all(scheduler, runner)  # checks the KV of every computed slot
    assert len(first[0] + tokens["remote"]) == 4
    assert finished["remote"].finish_reason == FinishReason.LENGTH


def test_a_failed_load_is_recomputed_and_gives_the_same_tokens():
    prompt = distinct_prompt(0, 3 * BLOCK_SIZE + 1)
    reference = make_scheduler(64)
    reference.add_request(make_request("r", prompt))
    expected, _, _ = run_all(reference, FakeRunner())
    scheduler = make_scheduler(64, kv_transfer=consumer("recompute"))
    runner = RemoteRunner(delay=1, fail=True)
    add(scheduler, runner, "r", prompt)
    tokens, _, outputs = run_all(scheduler, runner)
    assert tokens == expected
    assert sum(so.num_scheduled_tokens.get("r", 0) for so in outputs) >= len(prompt)


def test_a_failed_load_fails_the_request_with_policy_fail():
    scheduler = make_scheduler(64, kv_transfer=consumer("fail"))
    runner = RemoteRunner(delay=1, fail=True)
    add(scheduler, runner, "r", distinct_prompt(0, 3 * BLOCK_SIZE + 1))
    tokens, finished, _ = run_all(scheduler, runner)
    assert finished["r"].finish_reason == FinishReason.ERROR and not tokens["r"]
    assert "failed to load" in str(finished["r"].stop_reason)


def test_a_request_aborted_while_it_loads_frees_its_blocks_and_cancels_its_pull():
    scheduler = make_scheduler(64, kv_transfer=consumer())
    runner = RemoteRunner(delay=50)
    add(scheduler, runner, "r", distinct_prompt(0, 5 * BLOCK_SIZE))
    step(scheduler, runner)
    assert scheduler.kv_cache_manager.usage > 0
    scheduler.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    assert scheduler.kv_cache_manager.usage == 0 and not scheduler.has_unfinished_requests()
    step(scheduler, runner)
    assert runner.cancelled == ["r"] and not runner.pulls


def test_params_of_another_prompt_load_nothing():
    scheduler = make_scheduler(64, kv_transfer=consumer())
    runner = RemoteRunner()
    prompt = distinct_prompt(0, 3 * BLOCK_SIZE)
    params = remote(distinct_prompt(1, 3 * BLOCK_SIZE))
    runner.prompts["r"] = prompt
    scheduler.add_request(make_request("r", prompt, extra_args=params))
    so, _ = step(scheduler, runner)
    assert so.num_scheduled_tokens == {"r": len(prompt)}  # computed here, nothing pulled
    run_all(scheduler, runner)


def test_blocks_still_loading_are_no_prefix_hit_for_another_request():
    scheduler = make_scheduler(64, kv_transfer=consumer())
    runner = RemoteRunner(delay=3)
    prompt = distinct_prompt(0, 4 * BLOCK_SIZE + 1)
    add(scheduler, runner, "remote", prompt)
    step(scheduler, runner)
    runner.prompts["local"] = prompt
    scheduler.add_request(make_request("local", prompt))
    so, _ = step(scheduler, runner)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0  # computes all of it
    run_all(scheduler, runner)  # checks every computed slot's KV
