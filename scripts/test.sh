#!/usr/bin/env bash
# Install Kiln with its test dependencies and the test plugin into .venv, then run the tests.
# Extra arguments go to pytest (e.g. scripts/test.sh tests/plugins -x).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh --test
exec .venv/bin/python -m pytest "$@"
