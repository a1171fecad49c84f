#!/usr/bin/env bash
# Install xgrammar (constrained decoding) into the venv given as $1, without its declared
# requirements: its wheel asks for torch, transformers and triton, but ninfer_mlc uses only its
# native core through tvm-ffi (runtime/grammar.py), which needs apache-tvm-ffi and numpy, both
# already project dependencies. Pinned: runtime/grammar.py calls that core's bindings directly.
set -euo pipefail
"$1/bin/pip" install -q --no-deps "xgrammar==0.2.8"
