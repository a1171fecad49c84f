#!/usr/bin/env bash
# Serve the embedded tiny model (or any MODEL: ./scripts/serve.sh Qwen/Qwen3.6-27B) on http://127.0.0.1:8080.
# Installs the project into .venv on the first run only (scripts/ensure_venv.sh), then starts at once.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/ensure_venv.sh
exec .venv/bin/ninfer serve "$@"
