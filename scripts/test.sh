#!/usr/bin/env bash
# Install the project with its test extra into .venv (once; again when pyproject.toml changes) and run the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/ensure_venv.sh test
# the DFlash drafter tests' independent reference: the PyPI package's PyTorch model (dflash/model.py needs
# only torch and transformers, both test dependencies; its declared requirements pin datasets/requests/tqdm
# for its benchmark script)
.venv/bin/pip show dflash 2>/dev/null | grep -qx 'Version: 0.1.0' || .venv/bin/pip install -q --no-deps "dflash==0.1.0"
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) || echo "chromium unavailable: monitor browser test will skip"
fi
# the real agent CLIs for tests/test_agent_clients.py, pinned (native binaries shipped in the npm packages)
AGENT_CLIS=(@anthropic-ai/claude-code@2.1.332 @openai/codex@0.171.0)
if command -v npm >/dev/null 2>&1; then
  want="$(printf '%s\n' "${AGENT_CLIS[@]}")"
  if [ "$(cat build/agent-clients/.pinned 2>/dev/null)" != "$want" ]; then
    mkdir -p build/agent-clients
    if npm install --prefix build/agent-clients --no-audit --no-fund --no-save --loglevel=error "${AGENT_CLIS[@]}" >/dev/null; then
      printf '%s\n' "$want" > build/agent-clients/.pinned
    else
      echo "npm install of ${AGENT_CLIS[*]} failed: the agent CLI tests will skip"
    fi
  fi
else
  echo "npm not found: the agent CLI tests (tests/test_agent_clients.py) will skip"
fi
# lint and type-check before the (minutes-long) suite; either failing fails the run
.venv/bin/ruff check .
./scripts/typecheck.sh
exec .venv/bin/python -m pytest "$@"
