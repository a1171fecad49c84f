#!/usr/bin/env bash
# Install the project with its test extra into .venv (once; again when pyproject.toml changes) and run the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/ensure_venv.sh test
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) || echo "chromium unavailable: monitor browser test will skip"
fi
exec .venv/bin/python -m pytest "$@"
