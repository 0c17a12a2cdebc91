#!/usr/bin/env bash
# On a GPU machine: the kernel tests on CUDA, then the kernel benchmark. Results go to $OUT (default results/).
# Wheels in .whl/ (e.g. fla-core for the chain baseline) are installed to /tmp/site first.
set -uo pipefail
OUT=${OUT:-results}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
python3 -m pytest -q -p no:cacheprovider tests/kernels 2>&1 | tee "$OUT/gpu_kernel_tests.log" | tail -15
python3 eval/bench_kernels.py --out "$OUT/kernels.jsonl" "$@" 2>&1 | tee "$OUT/bench_kernels.log"
