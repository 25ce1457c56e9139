"""The conformance kit's checks fail when a plugin is wrong (so a passing kit means something)."""

import pytest

from kiln.testing import run_check

pytestmark = pytest.mark.plugin


def test_ops_check_catches_an_implementation_that_differs_from_native():
    result = run_check("ops", "kiln_test", {"KILN_TEST_PLATFORM": "1", "KILN_TEST_WRONG_OP": "1"})
    status = {r["provider"]: r["status"] for r in result["results"]}
    assert status["kiln_test_wrong"] == "mismatch"
    assert status["kiln_test_fast"] == "ok"
    assert status["kiln_test_generic"] == "ok"


def test_idempotence_check_runs_register_again_on_the_builtin_platform():
    result = run_check("idempotence", "cpu")
    assert result["plugins"] == ["kiln_test", "kiln_test_failing"]
    assert result["equal"] and not result["errors"]
