#!/bin/bash
# Wheels the HTTP server needs on the H200 box (Python 3.12) beyond its image (which has numpy, ml_dtypes,
# safetensors, tokenizers, jinja2, httpx, idna, torch): FastAPI, Starlette, pydantic, uvicorn and their
# pure-Python dependencies, at the versions this checkout's .venv runs (so the server there is the one
# tested here). Usage, from the repo root: bash bench/serve_wheels.sh [DEST=.gpu/servewhl]
# gpu_driver.sh's serve / agent steps install DEST/*.whl into /tmp/site.
set -eu
DEST=${1:-.gpu/servewhl}
PY=${PY:-.venv/bin/python}
mkdir -p "$DEST"
PKGS=""
for p in fastapi starlette pydantic pydantic-core annotated-types annotated-doc typing-inspection typing-extensions \
         opentelemetry-api uvicorn h11 click anyio; do
  v=$($PY -m pip show "$p" 2>/dev/null | awk '/^Version:/{print $2}')
  [ -n "$v" ] && PKGS="$PKGS $p==$v"
done
echo "wheels:$PKGS"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DEST" $PKGS
du -sh "$DEST"
