#!/usr/bin/env bash
# Install Kiln with its test dependencies and the test plugin into .venv, check lint and format,
# type-check src/kiln, then run the tests.
# Extra arguments go to pytest (e.g. scripts/test.sh tests/plugins -x).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh --test
# Lint and formatting first: cheap, and a failure names the line.
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# Types ([tool.mypy] in pyproject.toml); the path is explicit so that the checkout's own sources
# are checked, not whatever `kiln` the environment resolves.
.venv/bin/python -m mypy src/kiln
exec .venv/bin/python -m pytest "$@"
