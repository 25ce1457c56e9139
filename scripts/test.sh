#!/usr/bin/env bash
# Install Kiln with its test dependencies and the test plugin into .venv, check lint and format,
# then run the tests while type-checking src/kiln and the kiln-x86 plugin.
# Extra arguments go to pytest (e.g. scripts/test.sh tests/plugins -x; -n 0 runs in this process).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh --test
# Lint and formatting first: cheap, and a failure names the line.
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# Types ([tool.mypy] in pyproject.toml) of Kiln and of kiln-x86, checked while the tests run (one
# process beside them; run alone it adds a minute to every run): its report follows pytest's, and
# either failing fails the run. Paths, so that this checkout's sources are checked, not whatever
# the environment resolves.
types_log=$(mktemp)
trap 'rm -f "$types_log"' EXIT
.venv/bin/python -m mypy src/kiln plugins/kiln-x86/src/kiln_x86 >"$types_log" 2>&1 &
types_pid=$!
# Two worker processes (pytest-xdist), a test file each at a time: a module's tests share its
# server or LLM on one worker, and while one worker waits on a process it started, the other
# computes. Two, not one per core: each worker and each process it starts loads the model.
tests=0
.venv/bin/python -m pytest -n 2 --dist loadfile "$@" || tests=$?
types=0
wait "$types_pid" || types=$?
echo "mypy (src/kiln, kiln-x86):"
cat "$types_log"
if [ "$types" -ne 0 ]; then
    echo "mypy failed (exit $types)"
fi
if [ "$tests" -ne 0 ]; then
    exit "$tests"
fi
exit "$types"
