#!/usr/bin/env bash
# The wheels the device machine lacks (docs/gpu.md, "What it needs"), into .whl/ for the run call's carry:
#
#   bash scripts/gpu/fetch_wheels.sh          # then run(..., carry=[".whl"])
#
# Also into .whl/test/ (not installed by run_suite.sh): hypothesis and what it needs, for CPU tests run on
# the device (`pip install --no-index --no-deps --target /tmp/site .whl/test/*.whl`, docs/gpu.md).
#
# Versions come from requirements.lock (fla, a GPU extra, is pinned here); CPython 3.12, manylinux x86_64.
# The device has no package registry: run this where PyPI is reachable.
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=.whl
FLA_VERSION=${FLA_VERSION:-0.6.0}
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
NAMES=(pyzmq megatron-core pydantic pydantic-core annotated-types typing-inspection typing-extensions
       fastapi starlette opentelemetry-api uvicorn h11 click msgspec math-verify latex2sympy2-extended
       antlr4-python3-runtime isal annotated-doc einops)
specs=()
for name in "${NAMES[@]}"; do
    line=$(grep -i "^${name}==" requirements.lock) || { echo "fetch_wheels: $name is not in requirements.lock" >&2; exit 2; }
    specs+=("${line%% *}")
done
specs+=("fla-core==$FLA_VERSION" "flash-linear-attention==$FLA_VERSION")
mkdir -p "$DEST"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$DEST" "${specs[@]}"
test_specs=()
for name in hypothesis attrs sortedcontainers; do
    line=$(grep -i "^${name}==" requirements.lock) || { echo "fetch_wheels: $name is not in requirements.lock" >&2; exit 2; }
    test_specs+=("${line%% *}")
done
mkdir -p "$DEST/test"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$DEST/test" "${test_specs[@]}"
ls "$DEST" | wc -l | xargs echo "wheels in $DEST:"
du -sh "$DEST"
