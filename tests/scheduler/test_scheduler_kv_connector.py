"""The scheduler with a KV connector, no model: the offloading connector's CPU tier against
``FakeRunner``, whose KV cache holds token ids, so a block loaded from the tier with the wrong
contents fails ``check_kv`` at once. ``TieredRunner`` executes the connector's metadata as the
worker side does: loads before the step's writes, saves after them.

The worker side's tensors and a real model are tested in ``tests/kv_transfer``.
"""

from __future__ import annotations

import pathlib
import sys

import pytest

from kiln.config import KVTransferConfig
from kiln.kv_transfer import KV_CONNECTOR_REGISTRY, NoConnector
from kiln.kv_transfer.offloading import OffloadingConnector, OffloadingMetadata
from kiln.messages import FinishReason, KVConnectorOutput, ModelRunnerOutput, SchedulerOutput
from kiln.scheduler.request import RequestStatus
from kiln.scheduler.scheduler import Scheduler
from kiln.testing.scheduler import BLOCK_SIZE, make_request, make_scheduler

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from test_scheduler import FakeRunner, distinct_prompt, run_all  # noqa: E402

BYTES_PER_BLOCK = 1024


def offloading(num_slots: int, role: str = "kv_both") -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role=role,
        kv_connector_extra_config={"cpu_bytes": num_slots * BYTES_PER_BLOCK},
    )


class TieredRunner(FakeRunner):
    """``FakeRunner`` plus the CPU tier: a slot holds one block's token ids."""

    def __init__(self) -> None:
        super().__init__()
        self.pool: dict[int, list[int | None]] = {}
        self.num_loaded = 0
        self.num_saved = 0

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        metadata: OffloadingMetadata | None = so.kv_connector_metadata
        if metadata is not None:
            slots = [slot for _, slot in metadata.saves]
            assert len(slots) == len(set(slots)), "a slot saved twice in one step"
            for slot, block_id in metadata.loads:
                for offset, token in enumerate(self.pool[slot]):
                    self.kv[(block_id, offset)] = token
            self.num_loaded += len(metadata.loads)
        output = super().execute(so)  # writes the step's tokens, checks every computed slot
        if metadata is not None:
            for block_id, slot in metadata.saves:
                self.pool[slot] = [self.kv.get((block_id, o)) for o in range(BLOCK_SIZE)]
            self.num_saved += len(metadata.saves)
        return output


def run(scheduler: Scheduler, runner: FakeRunner, *requests) -> dict[str, list[int]]:
    for request in requests:
        scheduler.add_request(request)
    tokens, _, _ = run_all(scheduler, runner)
    return tokens


def test_a_prefix_evicted_from_the_cache_is_loaded_from_the_cpu_tier():
    # 12 usable blocks of 4 slots: two 40-token prompts cannot both stay cached.
    scheduler = make_scheduler(13, kv_transfer=offloading(64))
    assert isinstance(scheduler.transfers.connector, OffloadingConnector)
    runner = TieredRunner()
    prompt_a, prompt_b = distinct_prompt(0, 40), distinct_prompt(1, 40)
    first = run(scheduler, runner, make_request("a1", prompt_a))
    run(scheduler, runner, make_request("b1", prompt_b))
    assert runner.num_saved >= 2 * 40 // BLOCK_SIZE
    # A freed table is evicted tail first: the paged cache kept a's first block only.
    assert scheduler.kv_cache_manager.get_computed_blocks(make_request("x", prompt_a))[1] == 4

    again = make_request("a2", prompt_a)
    scheduler.add_request(again)
    so = scheduler.schedule()
    # The first block from the paged cache, the next 8 from the tier: all but the block that
    # holds the last prompt token, which is computed.
    assert so.scheduled_new_reqs[0].num_computed_tokens == 36
    assert so.num_scheduled_tokens == {"a2": 4}
    assert len(so.kv_connector_metadata.loads) == 8
    outputs = scheduler.update_from_output(so, runner.execute(so))  # check_kv: loads are right
    assert outputs.scheduler_stats.kv_connector_stats == {"hit_tokens": 32}
    tokens, _, _ = run_all(scheduler, runner)
    assert outputs.outputs[0].new_token_ids + tokens["a2"] == first["a1"]
    assert again.num_cached_tokens == 36


def test_hits_count_local_blocks_first_then_the_tier():
    scheduler = make_scheduler(13, kv_transfer=offloading(64))
    runner = TieredRunner()
    prompt = distinct_prompt(0, 40)
    run(scheduler, runner, make_request("a1", prompt))
    # A second request with the same prefix right away: all from the local cache.
    scheduler.add_request(make_request("a2", prompt))
    so = scheduler.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 36
    assert so.kv_connector_metadata is None or not so.kv_connector_metadata.loads
    scheduler.update_from_output(so, runner.execute(so))
    run_all(scheduler, runner)


def test_the_tier_evicts_least_recently_used_blocks_and_forgets_them():
    # A tier of 4 blocks: the first prompt's 10 full blocks cannot all stay.
    scheduler = make_scheduler(13, kv_transfer=offloading(4))
    runner = TieredRunner()
    prompt_a, prompt_b = distinct_prompt(0, 40), distinct_prompt(1, 40)
    run(scheduler, runner, make_request("a1", prompt_a))
    run(scheduler, runner, make_request("b1", prompt_b))
    assert len(runner.pool) == 4
    # prompt a's first blocks left the tier: nothing past the local cache can be supplied
    request = make_request("a2", prompt_a)
    scheduler.kv_cache_manager.get_computed_blocks(request)
    assert scheduler.transfers.connector.get_num_new_matched_tokens(request, 0) == (0, False)
    # prompt b's last full blocks are the tier's, but a prefix must start at block 0
    request = make_request("b2", prompt_b)
    scheduler.kv_cache_manager.get_computed_blocks(request)
    assert scheduler.transfers.connector.get_num_new_matched_tokens(request, 0) == (0, False)
    run(scheduler, runner, make_request("a3", prompt_a))  # recomputed, and right


def test_roles_producer_saves_only_consumer_loads_only():
    for role, saves in (("kv_producer", True), ("kv_consumer", False)):
        scheduler = make_scheduler(13, kv_transfer=offloading(64, role))
        runner = TieredRunner()
        run(scheduler, runner, make_request("a1", distinct_prompt(0, 40)))
        assert (runner.num_saved > 0) == saves, role
        run(scheduler, runner, make_request("b1", distinct_prompt(1, 40)))
        run(scheduler, runner, make_request("a2", distinct_prompt(0, 40)))
        assert runner.num_loaded == 0, role


def test_a_failed_step_leaves_no_block_of_it_in_the_tier():
    scheduler = make_scheduler(13, kv_transfer=offloading(64), max_num_batched_tokens=16)
    runner = TieredRunner()
    prompt = distinct_prompt(0, 40)
    scheduler.add_request(make_request("a1", prompt))
    so = scheduler.schedule()  # the first 16 tokens: 4 full blocks, saved after the step
    assert len(so.kv_connector_metadata.saves) == 4
    output = runner.execute(so)
    output.failed_requests = {"a1": "the step failed for it"}
    scheduler.update_from_output(so, output)
    assert scheduler.requests == {}
    request = make_request("a2", prompt)
    scheduler.kv_cache_manager.get_computed_blocks(request)
    assert scheduler.transfers.connector.get_num_new_matched_tokens(request, 0) == (0, False)


def test_without_a_connector_the_scheduler_holds_the_null_one():
    scheduler = make_scheduler()
    assert type(scheduler.transfers.connector) is NoConnector
    scheduler.add_request(make_request("a", 8))
    assert scheduler.schedule().kv_connector_metadata is None


def test_bad_connector_configs_name_the_field():
    with pytest.raises(ValueError, match="kv_transfer.kv_connector='Nope'.*OffloadingConnector"):
        make_scheduler(kv_transfer=KVTransferConfig(kv_connector="Nope"))
    with pytest.raises(ValueError, match="cache.enable_prefix_caching=False"):
        make_scheduler(kv_transfer=offloading(8), enable_prefix_caching=False)
    with pytest.raises(ValueError, match="kv_transfer.kv_offloading_size"):
        make_scheduler(kv_transfer=KVTransferConfig(kv_connector="OffloadingConnector"))
    with pytest.raises(ValueError, match="at least one block"):
        make_scheduler(kv_transfer=offloading(8), bytes_per_block=BYTES_PER_BLOCK * 9)
    with pytest.raises(ValueError, match="kv_transfer.kv_role='both'"):
        KVTransferConfig(kv_connector="OffloadingConnector", kv_role="both")
    with pytest.raises(ValueError, match="kv_transfer.kv_load_failure_policy"):
        KVTransferConfig(kv_load_failure_policy="retry")
    with pytest.raises(ValueError, match="kv_transfer.kv_offloading_size"):
        KVTransferConfig(kv_offloading_size=2.0)  # without its connector
    with pytest.raises(ValueError, match="not a subclass of kiln.kv_transfer.KVConnectorBase"):
        make_scheduler(
            kv_transfer=KVTransferConfig(
                kv_connector="OrderedDict", kv_connector_module_path="collections"
            )
        )
    assert "OffloadingConnector" in KV_CONNECTOR_REGISTRY.names()


def test_local_hits_keep_their_blocks_in_the_tier():
    # A tier of 6 blocks under a paged cache of 24: a prefix hit in the paged cache counts as a
    # use in the tier too, so churn evicts the others first.
    scheduler = make_scheduler(25, kv_transfer=offloading(6))
    runner = TieredRunner()
    prompt_a = distinct_prompt(0, 16)
    run(scheduler, runner, make_request("a1", prompt_a, max_tokens=1))  # a's 4 blocks
    run(scheduler, runner, make_request("b1", distinct_prompt(1, 8), max_tokens=1))  # 2 more
    run(scheduler, runner, make_request("a2", prompt_a, max_tokens=1))  # 3 local hits: touched
    run(scheduler, runner, make_request("c1", distinct_prompt(2, 8), max_tokens=1))  # evicts 2
    request = make_request("a3", prompt_a)
    scheduler.kv_cache_manager.get_computed_blocks(request)
    assert scheduler.transfers.connector.get_num_new_matched_tokens(request, 0) == (12, False)


class FailingLoadsRunner(TieredRunner):
    """Reports every block it loads as failed (it still writes the right tokens, so
    ``check_kv`` passes: what is tested is what the scheduler makes of the report)."""

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        output = super().execute(so)
        metadata: OffloadingMetadata | None = so.kv_connector_metadata
        if metadata is not None and metadata.loads:
            failed = {block_id for _, block_id in metadata.loads}
            output.kv_connector_output = KVConnectorOutput(invalid_block_ids=failed)
        return output


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_failed_loads_recompute_or_fail_the_request(policy):
    config = offloading(64)
    config = KVTransferConfig(**{**config.__dict__, "kv_load_failure_policy": policy})
    scheduler = make_scheduler(13, kv_transfer=config)
    runner = FailingLoadsRunner()
    prompt_a = distinct_prompt(0, 40)
    first = run(scheduler, runner, make_request("a1", prompt_a))
    run(scheduler, runner, make_request("b1", distinct_prompt(1, 40)))
    scheduler.add_request(make_request("a2", prompt_a))
    so = scheduler.schedule()
    assert len(so.kv_connector_metadata.loads) == 8
    outputs = scheduler.update_from_output(so, runner.execute(so))
    assert outputs.scheduler_stats.kv_connector_stats["failed_loads"] == 1
    # The step's token is dropped either way: it came from KV the runner could not load.
    if policy == "fail":
        (failed,) = outputs.outputs
        assert failed.finish_reason == FinishReason.ERROR and failed.new_token_ids == []
        assert scheduler.requests == {}
        return
    assert outputs.outputs == [] and scheduler.requests["a2"].status == RequestStatus.PREEMPTED
    assert "a2" in scheduler.finished_req_ids  # the runner drops its state
    so = scheduler.schedule()  # readmitted: the blocks after the paged hit are computed
    assert so.scheduled_new_reqs[0].num_computed_tokens == 4
    assert not so.kv_connector_metadata or not so.kv_connector_metadata.loads  # not asked again
    outputs = scheduler.update_from_output(so, runner.execute(so))
    tokens, _, _ = run_all(scheduler, runner)
    assert [t for o in outputs.outputs for t in o.new_token_ids] + tokens.get("a2", []) == first[
        "a1"
    ]


def test_a_requests_loads_are_taken_before_its_local_hits_can_evict_them():
    # A one-slot tier holding block 1 of a prompt whose block 0 is a local hit only: saving
    # block 0 (a local hit counts as a use) takes the slot, after block 1 was loaded from it.
    scheduler = make_scheduler(13, kv_transfer=offloading(1))
    connector = scheduler.transfers.connector
    prompt = distinct_prompt(0, 12)
    first = make_request("r0", prompt)
    scheduler.kv_cache_manager.get_computed_blocks(first)  # its block hashes
    assert connector.get_num_new_matched_tokens(first, 8) == (0, False)
    connector.update_state_after_alloc(first, [5, 6, 7], 0)  # block 1's save overtakes block 0's
    assert scheduler.schedule().kv_connector_metadata.saves == [(6, 0)]  # the step's metadata

    again = make_request("r1", prompt)
    scheduler.kv_cache_manager.get_computed_blocks(again)
    assert connector.get_num_new_matched_tokens(again, 4) == (BLOCK_SIZE, False)
    connector.update_state_after_alloc(again, [8, 9, 10], BLOCK_SIZE)
    metadata = scheduler.schedule().kv_connector_metadata
    assert metadata.loads == [(0, 9)]  # block 1 from the slot, before the forward
    assert metadata.saves == [(8, 0)]  # then block 0 into it, after the forward
