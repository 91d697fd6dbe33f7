#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py) on a CUDA machine that may have no package index:
# wheels carried in .whl/ (the `cuda` extra, flashinfer-python, and whatever else the machine
# lacks, e.g. `pip download --no-deps --only-binary=:all: -d .whl flashinfer-python==VERSION`)
# are installed into a scratch folder first; then the check runs with any arguments given
# (e.g. `--save-kernels .whl/flashinfer-kernels.tgz` once, `--kernels .whl/flashinfer-kernels.tgz`
# on later checks: FlashInfer's compiled modules instead of a ~2-minute compile).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" > /dev/null; then
    site=$(mktemp -d)
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
exec "$PY" benchmarks/gpu_check.py "$@"
