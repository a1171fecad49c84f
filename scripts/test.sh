#!/usr/bin/env bash
# Install the project with its test extra into .venv and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q -e '.[test]'
./scripts/install-xgrammar.sh .venv
# the DFlash drafter tests' independent reference: the PyPI package's PyTorch model (dflash/model.py needs
# only torch and transformers, both test dependencies; its declared requirements pin datasets/requests/tqdm
# for its benchmark script)
.venv/bin/pip install -q --no-deps "dflash==0.1.0"
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) || echo "chromium unavailable: monitor browser test will skip"
fi
exec .venv/bin/python -m pytest "$@"
