#!/usr/bin/env bash
# Install Kiln with its test dependencies and the test plugin into .venv, check lint and format,
# type-check src/kiln and the kiln-x86 plugin, then run the tests.
# Extra arguments go to pytest (e.g. scripts/test.sh tests/plugins -x).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh --test
# Lint and formatting first: cheap, and a failure names the line.
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# Types ([tool.mypy] in pyproject.toml) of Kiln and of kiln-x86; paths, so that this checkout's
# sources are checked, not whatever the environment resolves.
.venv/bin/python -m mypy src/kiln plugins/kiln-x86/src/kiln_x86
exec .venv/bin/python -m pytest "$@"
