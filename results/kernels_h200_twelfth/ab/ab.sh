#!/usr/bin/env bash
# A/B of the closed form's kernels, twelfth session, at issue 2's two target shapes: main (configs pruned at BT = 128)
# beside four branches whose kernel files travel as wip/NAME/closed_form_kernels.py: reorder (the off-diagonal
# program's decays before its Gram products), splitc (the diagonal blocks' C in programs of their own), quarters (the
# diagonal blocks' inverses on quarter tiles), apply2 (the apply kernel's Q S_pre products after the wait, per half).
# To run it again, put each branch's file in place first (branches wip-reorder, wip-splitc, wip-quarters2, wip-apply2):
#   for b in reorder:reorder splitc:splitc quarters:quarters2 apply2:apply2; do mkdir -p wip/${b%:*}
#       git show wip-${b#*:}:hf_bole/kernels/tree_gdn/closed_form_kernels.py > wip/${b%:*}/closed_form_kernels.py; done
# Phase 1 runs every variant's kernel tests and a first benchmark side by side, in a copy of the tree each: that
# compiles every kernel into Triton's shared cache (on a fresh machine the compiles outlasted a 110 s benchmark). Phase
# 2 times the variants one after the other on the otherwise idle GPU. Logs come back as ab.tgz (at most 8 files do).
set -uo pipefail
OUT=${OUT:-/tmp/ab}; mkdir -p "$OUT"; LOGS=/tmp/ablogs; mkdir -p $LOGS
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site-fla .whl/fla_core-*.whl
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
XD=$(python3 -c "import xdist" 2>/dev/null && echo "-n 3" || echo "")
VARIANTS=${VARIANTS:-main reorder splitc quarters apply2}
KF=hf_bole/kernels/tree_gdn/closed_form_kernels.py
for v in $VARIANTS; do
    mkdir -p /tmp/v/$v; tar --exclude=./results --exclude=./eval/house/checkpoint --exclude=./.git --exclude=./.venv --exclude=./.whl -cf - . | tar -xf - -C /tmp/v/$v
    [ $v = main ] || cp wip/$v/closed_form_kernels.py /tmp/v/$v/$KF
done
bench() {  # bench VARIANT NAME SECONDS
    (cd /tmp/v/$1 && BOLE_COMMIT="$1 (twelfth A/B)" PYTHONPATH=/tmp/v/$1:/tmp/site-fla PYTHONUNBUFFERED=1 timeout $3 python3 eval/bench_kernels.py \
        --providers bole solve --shapes 32,16,128 48,1,128 --out $LOGS/$2_$1.jsonl > $LOGS/$2_$1.log 2>&1)
}
echo "== phase 1: tests and a first benchmark of every variant, side by side"; s=$SECONDS
for v in $VARIANTS; do
    (cd /tmp/v/$v && PYTHONPATH=/tmp/v/$v:/tmp/site-fla timeout ${TEST_LIMIT:-170} python3 -m pytest -q -p no:cacheprovider $XD \
        tests/kernels/test_closed_form.py > $LOGS/tests_$v.log 2>&1) &
    bench $v warm ${WARM_LIMIT:-170} &
done
wait; echo "phase 1: $((SECONDS - s)) s"
for v in $VARIANTS; do echo "tests $v: $(tail -1 $LOGS/tests_$v.log)"; done
tar -czf "$OUT/ab.tgz" -C $LOGS .
echo "== phase 2: the benchmark, one variant at a time"
for round in 1 2; do
    for v in $VARIANTS; do
        s=$SECONDS; bench $v ab$round ${LIMIT:-60}; echo "$v round $round: exit $? $((SECONDS - s)) s"
        grep -E "^ *(32|48) +(16|1) +128|failed|Error" $LOGS/ab${round}_$v.log | head -6
        tar -czf "$OUT/ab.tgz" -C $LOGS .  # after every benchmark: a run cut short keeps what it finished
    done
done
