#!/usr/bin/env bash
# Install the project into .venv and serve the embedded tiny model on http://127.0.0.1:8080.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q -e .
./scripts/install-xgrammar.sh .venv
exec .venv/bin/ninfer serve "$@"
