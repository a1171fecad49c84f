#!/usr/bin/env bash
# Usage: scripts/ensure_venv.sh [EXTRA]
# Create .venv once and install the project into it (editable, with the optional EXTRA, e.g. `test`).
# Later calls do nothing unless pyproject.toml (or the pinned xgrammar install) changed since that install:
# code edits need no reinstall (editable), dependency changes do. The stamp .venv/.ninfer-install-<extra>
# holds the sha256 of what it was installed from; an install with an extra also covers a plain one.
set -euo pipefail
cd "$(dirname "$0")/.."
extra="${1:-}"
want="$(cat pyproject.toml scripts/install-xgrammar.sh | sha256sum | cut -d' ' -f1)"
installed() { [ -x .venv/bin/ninfer ] && [ "$(cat ".venv/.ninfer-install-$1" 2>/dev/null)" = "$want" ]; }
if installed "${extra:-base}"; then exit 0; fi
if [ -z "$extra" ]; then
  for stamp in .venv/.ninfer-install-*; do
    [ -e "$stamp" ] && installed "${stamp#.venv/.ninfer-install-}" && exit 0
  done
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
echo "ninfer: installing the project into .venv (once; again only when pyproject.toml changes)" >&2
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q -e ".${extra:+[$extra]}"
./scripts/install-xgrammar.sh .venv
echo "$want" > ".venv/.ninfer-install-${extra:-base}"
