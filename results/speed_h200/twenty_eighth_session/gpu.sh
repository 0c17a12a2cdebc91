#!/usr/bin/env bash
# The twenty-eighth session's GPU runs (README.md beside this file says what each measured).
# Usage, from the repository root, with fla-core's wheel in .whl/:
#   OUT=... bash results/speed_h200/twenty_eighth_session/gpu.sh PART...   (parts in turn, on one machine)
# Every part reads the house model's tables that the twenty-seventh session calibrated (installed first).
set -uo pipefail
. eval/gpu_preamble.sh
mkdir -p "$HF_BOLE_CACHE/budgets"
cp results/speed_h200/twenty_seventh_session/tables/*.json "$HF_BOLE_CACHE/budgets/"
for PART in "$@"; do
case $PART in
mbpp_b8)  # the README's MBPP batch-8 house rows at the default epsilon 0.3 (bole 384 nodes, tree-serial 64)
    house_run mbpp_b8 180 mbpp --modes ar chain tree-serial bole --batch-sizes 8
    ;;
sweep)  # issue 5 on the house model after 8d8fd7a (the line between batch buckets, epsilon 0.3): the best fixed
        # budgets of the twenty-seventh session's sweep, and auto; results.jsonl kept for the plot
    STEP_SHOWS="^\| gsm8k" STEP_TAIL=40 step sweep "${SWEEP_S:-300}" python3 eval/run.py --datasets gsm8k --modes bole \
        --batch-sizes ${SWEEP_BATCHES:-16 8 4 1} --num-prompts 16 --max-new-tokens 96 --budget 32 128 256 auto --repeats 3 \
        --interleave --output-dir "$OUT/sweep"
    rm -f "$OUT/sweep"/*.png "$OUT/sweep"/run.log
    ;;
serial_sweep)  # each tree algorithm at its own best fixed budget, MBPP batch 8 (issue 8's bole / tree-serial)
    house_run serial_sweep "${SERIAL_S:-240}" mbpp --modes tree-serial bole --batch-sizes 8 --budget 32 64 128 256 auto
    ;;
tests)  # the CUDA tests that compile (torch.compile), one of which the twenty-seventh session's step did not reach
    HF_BOLE_TEST_DEVICE=cuda step tests 240 python3 -m pytest -q -p no:cacheprovider -rA --tb=short \
        tests/generation/test_loop.py -k "compile"
    ;;
*)
    echo "unknown part $PART"
    ;;
esac
done
