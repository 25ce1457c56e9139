#!/usr/bin/env bash
# Install Kiln with its test dependencies and the test plugin into .venv, check lint and format,
# type-check src/kiln and the kiln-x86 plugin, then run the tests.
# Extra arguments go to pytest (e.g. scripts/test.sh tests/plugins -x; -n 0 runs in this process).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh --test
# Lint and formatting first: cheap, and a failure names the line.
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# Types ([tool.mypy] in pyproject.toml) of Kiln and of kiln-x86; paths, so that this checkout's
# sources are checked, not whatever the environment resolves.
.venv/bin/python -m mypy src/kiln plugins/kiln-x86/src/kiln_x86
# Two worker processes (pytest-xdist), a test file each at a time: a module's tests share its
# server or LLM on one worker, and while one worker waits on a process it started, the other
# computes. Two, not one per core: each worker and each process it starts loads the model.
exec .venv/bin/python -m pytest -n 2 --dist loadfile "$@"
