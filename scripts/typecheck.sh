#!/usr/bin/env bash
# Usage: scripts/typecheck.sh [MYPY]
# Run mypy ([tool.mypy] in pyproject.toml) over the installed package as Python imports it: compile/ and
# runtime/ ship as ninfer_mlc.compile / ninfer_mlc.runtime (setuptools package-dir), and their relative
# imports (`from ...contract import ...`) only resolve under that name. mypy has no package-dir mapping and
# cannot follow the editable install's import hook, so this mirrors the layout as a tree of symlinks under
# build/typecheck/ and checks that; reported paths are mapped back to the repository's own.
set -euo pipefail
cd "$(dirname "$0")/.."
mypy="${1:-.venv/bin/mypy}"
tree=build/typecheck
rm -rf "$tree" && mkdir -p "$tree/ninfer_mlc"
for entry in ninfer_mlc/*; do ln -s "$PWD/$entry" "$tree/ninfer_mlc/"; done
ln -s "$PWD/compile" "$tree/ninfer_mlc/compile"
ln -s "$PWD/runtime" "$tree/ninfer_mlc/runtime"
"$mypy" "$tree/ninfer_mlc" | sed -E "s#^$tree/ninfer_mlc/(compile|runtime)/#\1/#; s#^$tree/##"
