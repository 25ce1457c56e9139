"""Each of the conformance kit's checks fails, with a message that says what is wrong, against a
deliberately broken plugin (so a passing kit means something). The broken behaviours are the test
plugin's, switched on by ``KILN_TEST_*`` variables (see ``kiln_test_plugin/__init__.py``)."""

import json

import pytest

from kiln.testing import (
    LogitsTolerance,
    compare_greedy,
    plugin_report,
    reference_greedy,
    run_check,
)
from kiln.testing import conformance as kit

pytestmark = pytest.mark.plugin

PLATFORM = {"KILN_TEST_PLATFORM": "1"}


def test_ops_check_catches_an_implementation_off_by_a_little():
    env = {**PLATFORM, "KILN_TEST_WRONG_OP": "1"}
    result = run_check("ops", "kiln_test", env)
    status = {r["provider"]: r["status"] for r in result["results"] if r["op"] == "kiln_test_scale"}
    assert status == {
        "kiln_test_wrong": "mismatch",
        "kiln_test_fast": "ok",
        "kiln_test_generic": "ok",
        "kiln_test_nested": "ok",
    }
    with pytest.raises(AssertionError, match=r"kiln_test_scale\[kiln_test_wrong\]: Tensor-likes"):
        kit.test_op_implementations_match_native("kiln_test", env)


def test_idempotence_check_sees_kilns_ops_and_passes_a_well_behaved_plugin():
    result = run_check("idempotence", "cpu")
    assert result["plugins"] == ["kiln_test", "kiln_test_failing"]
    assert result["equal"] and not result["errors"]
    # The snapshot holds Kiln's own ops, not empty lists.
    ops = {name for name, _ in result["before"]["ops"]}
    assert {"rms_norm", "linear", "kiln_test_scale"} <= ops


def test_idempotence_check_catches_a_register_that_raises_when_run_again():
    env = {**PLATFORM, "KILN_TEST_NON_IDEMPOTENT": "raise"}
    with pytest.raises(AssertionError, match="register\\(\\) raised when run again") as info:
        kit.test_registration_is_idempotent("kiln_test", env)
    message = str(info.value)
    assert "kiln_test_fresh" in message and "already has an implementation" in message


def test_idempotence_check_catches_a_register_that_adds_entries_each_run():
    env = {**PLATFORM, "KILN_TEST_NON_IDEMPOTENT": "grow"}
    changed = "running register\\(\\) again changed registries"
    with pytest.raises(AssertionError, match=changed) as info:
        kit.test_registration_is_idempotent("kiln_test", env)
    assert "KilnTestRun2ForCausalLM" in str(info.value)


def test_interface_check_catches_a_missing_method():
    _rc, report = plugin_report("kiln_test", {**PLATFORM, "KILN_TEST_BAD_CLASS": "missing"})
    with pytest.raises(AssertionError, match="device.communicator_cls = .*lacks method 'barrier'"):
        kit.test_named_classes_implement_interfaces(report)


@pytest.fixture(scope="module")
def chunk_blind_greedy():
    """The greedy check on a platform whose attention ignores a prefill chunk's cached context."""
    env = {**PLATFORM, "KILN_TEST_BAD_CLASS": "chunk-blind"}
    return run_check("greedy", "kiln_test", env, json.dumps(reference_greedy()["tokens"]))


def test_the_greedy_check_runs_chunked_prefill_and_prefix_cache_hits():
    want = reference_greedy()
    budget = 16
    assert sum(n > budget for n in want["prompt_lens"]) >= 3  # prefilled in chunks
    assert sum(n >= 32 for n in want["cached_tokens"]) >= 2  # two blocks of the shared prefix


def test_greedy_check_catches_attention_that_is_wrong_on_chunked_prefill(chunk_blind_greedy):
    problem = compare_greedy(chunk_blind_greedy, reference_greedy())
    assert problem is not None
    assert "greedy token" in problem and "differs from the reference cpu platform's" in problem
    assert "from the prefix cache, prefilled in chunks of at most 16" in problem
    assert "top-1 agreement" in problem  # the measures, to judge how far off it is


def test_logits_tolerance_mode_catches_it_too(chunk_blind_greedy):
    problem = compare_greedy(chunk_blind_greedy, reference_greedy(), LogitsTolerance())
    assert problem is not None
    assert "top-1 agreement" in problem and "< min_top1_agreement 0.99" in problem
    assert "> max_logprob_diff 0.1" in problem


def test_logits_tolerance_mode_accepts_the_reference_within_its_thresholds():
    want = reference_greedy()
    exact = LogitsTolerance(min_top1_agreement=1.0, max_logprob_diff=0)
    assert compare_greedy(want, want, exact) is None


def test_scheduler_check_catches_a_scheduler_over_the_token_budget():
    env = {**PLATFORM, "KILN_TEST_BAD_CLASS": "over-budget"}
    with pytest.raises(AssertionError, match="OverBudgetScheduler: step 1 scheduled 32 tokens"):
        kit.test_scheduler_keeps_its_contract("kiln_test", env)


def test_scheduler_check_passes_a_scheduler_that_lowers_its_budget_per_step():
    result = run_check("scheduler", "kiln_test", {**PLATFORM, "KILN_TEST_BAD_CLASS": "dynamic"})
    assert result["scheduler_cls"].endswith("DynamicBatchScheduler")
    assert not result["problems"] and result["steps"] > 0


def test_communicator_check_catches_an_all_reduce_that_returns_its_input():
    env = {**PLATFORM, "KILN_TEST_BAD_CLASS": "copy-reduce"}
    with pytest.raises(AssertionError, match="all_reduce returned .* not the sum over ranks"):
        kit.test_communicator_keeps_its_contract("kiln_test", env)
