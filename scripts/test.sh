#!/usr/bin/env bash
# Install the project with its test extra into .venv and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q -e '.[test]'
./scripts/install-xgrammar.sh .venv
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) || echo "chromium unavailable: monitor browser test will skip"
fi
exec .venv/bin/python -m pytest "$@"
