#!/usr/bin/env bash
# Install Kiln and its default model into .venv, then show the platform and plugins it will use.
# (When the OpenAI-compatible server lands, this same command starts it.)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/kiln plugins "$@"
.venv/bin/python -c "from kiln.model_executor.loader.default_model import default_model_path as p; print('Default model:', p())"
