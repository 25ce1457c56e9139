#!/usr/bin/env bash
# Install Kiln and its default model into .venv, then start the OpenAI-compatible server on
# http://127.0.0.1:8000 (Ctrl-C stops it). Extra arguments go to `kiln serve`, e.g.
#   ./scripts/serve.sh --port 8080 --api-key secret
#   ./scripts/serve.sh path/to/model.gguf --max-model-len 4096
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/kiln serve "$@"
