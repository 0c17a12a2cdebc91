#!/usr/bin/env bash
# A/B of the closed form's kernels: main, wip-norms, wip-solve-quarters, side by side on one GPU (eleventh session)
set -uo pipefail
OUT=${OUT:-/tmp/ab}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site-fla .whl/fla_core-*.whl
export PYTHONPATH=/tmp/site-fla:$PYTHONPATH
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
XD=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8" || echo "")
KF=hf_bole/kernels/tree_gdn/closed_form_kernels.py
cp $KF /tmp/main_kernels.py; cp eval/tune_kernels.py /tmp/main_tune.py
use() { if [ $1 = main ]; then cp /tmp/main_kernels.py $KF; cp /tmp/main_tune.py eval/tune_kernels.py;
        else cp wip/$1/closed_form_kernels.py $KF; cp wip/$1/tune_kernels.py eval/tune_kernels.py; fi; }
st() { local n=$1 l=$2; shift 2; echo "== $n"; local s=$SECONDS; timeout $l "$@" > "$OUT/$n.log" 2>&1; echo "exit $? $((SECONDS-s)) s"; }
for v in main norms quarters; do
    use $v
    st ab_$v 110 python3 eval/bench_kernels.py --providers bole solve --shapes 32,16,128 48,1,128 --out "$OUT/ab_$v.jsonl"
    grep -E "^ *(32|48) |chosen|failed" "$OUT/ab_$v.log" | tail -8
done
use norms; st tests_norms 70 python3 -m pytest -q -p no:cacheprovider $XD tests/kernels/test_closed_form.py; tail -2 "$OUT/tests_norms.log"
use norms; st tune_norms 110 python3 eval/tune_kernels.py --shapes 32,16,128 48,1,128 --out "$OUT/tune_norms.jsonl"; tail -14 "$OUT/tune_norms.log"
use quarters; st tests_quarters 70 python3 -m pytest -q -p no:cacheprovider $XD tests/kernels/test_closed_form.py; tail -2 "$OUT/tests_quarters.log"
use main
