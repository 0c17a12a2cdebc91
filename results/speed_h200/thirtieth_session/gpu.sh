#!/usr/bin/env bash
# The thirtieth session's GPU runs (README.md beside this file says what each measured).
# Usage, from the repository root, with fla-core's wheel in .whl/:
#   OUT=... bash results/speed_h200/thirtieth_session/gpu.sh PART...   (parts in turn, on one machine)
# Every part reads the house model's tables that the twenty-seventh session calibrated (installed first).
set -uo pipefail
. eval/gpu_preamble.sh
mkdir -p "$HF_BOLE_CACHE/budgets"
cp results/speed_h200/twenty_seventh_session/tables/*.json "$HF_BOLE_CACHE/budgets/"
for PART in "$@"; do
case $PART in
tests)  # the RMSNorm kernels on CUDA (the kernel tests pick their device), then the verify forward's swapped norms
        # and fused projections with every model on the GPU
    step kernel_tests "${TESTS_S:-60}" python3 -m pytest -q -p no:cacheprovider -rf --tb=short \
        tests/kernels/test_rmsnorm.py
    HF_BOLE_TEST_DEVICE=cuda step model_tests "${MODEL_TESTS_S:-90}" python3 -m pytest -q -p no:cacheprovider -rf \
        --tb=short tests/models/test_norms.py tests/models/test_fused.py
    ;;
profile)  # every kernel of one batch-8 call of tree-serial and bole at depth 6, 128 nodes, and each call's GPU-busy
          # share of its wall time
    STEP_SHOWS="tree-serial|bole|draft|verify|busy" STEP_TAIL=60 step profile "${PROFILE_S:-150}" \
        python3 eval/profile_round.py --datasets mbpp --num-prompts 8 --max-new-tokens 128 --batch-sizes 8 \
        --modes tree-serial bole --depth 6 --budget 128 --kernel-log "$OUT/kernels"
    gzip -f "$OUT"/kernels/*.tsv
    ;;
sweep)  # tree-serial and bole at batch 8 over depths 6 and 7 and budgets 128 and 256: each at its own best
    house_run sweep "${SWEEP_S:-300}" mbpp --modes tree-serial bole --batch-sizes 8 --depth 6 7 --budget 128 256
    ;;
sweep_small)  # the same over depths 5 and 6 and budgets 64, 128 and 256 (smaller trees, where tree-serial's verify
              # costs less)
    house_run sweep_small "${SWEEP_S:-300}" mbpp --modes tree-serial bole --batch-sizes 8 --depth 5 6 \
        --budget 64 128 256
    ;;
ab)  # this checkout against the library at earlier commits (each commit's hf_bole/ unpacked by the caller into
     # .old_src/COMMIT/, run with this checkout's eval/ copied beside it, as eval/run.py puts its parent first on
     # sys.path): tree-serial and bole at batch 8, depth 6, 128 nodes; one process each, in the order of $AB (the
     # first with more time: on a fresh machine it compiles the kernels and the drafter's rounds first)
    LIMIT=${AB_FIRST_S:-220}
    for V in ${AB:-new}; do
        RUN=eval/run.py
        if [ "$V" != new ]; then cp -r eval ".old_src/$V/"; RUN=".old_src/$V/eval/run.py"; fi
        STEP_SHOWS="^\| mbpp|NOT a tie|^ran " STEP_TAIL=30 step "ab_$V" "$LIMIT" python3 -c "
import runpy, sys
sys.argv = ['$RUN'] + sys.argv[1:]
try:
    runpy.run_path('$RUN', run_name='__main__')
finally:
    print('ran', sys.modules['hf_bole'].__file__)" --datasets mbpp --num-prompts 8 --max-new-tokens 128 --profile \
            --interleave --output-dir "$OUT/ab_$V" --modes tree-serial bole --batch-sizes 8 --depth 6 --budget 128
        rm -f "$OUT/ab_$V"/*.png "$OUT/ab_$V"/results.jsonl "$OUT/ab_$V"/run.log
        LIMIT=${AB_S:-150}
    done
    ;;
confirm)  # not run this session: issue 8's ratio once more, with `ar` beside it for equality with plain greedy
    house_run confirm "${CONFIRM_S:-450}" mbpp --modes ar tree-serial bole --batch-sizes 8 --depth 6 7 \
        --budget 64 128 256
    ;;
*)
    echo "unknown part $PART"
    ;;
esac
done
