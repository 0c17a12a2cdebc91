#!/usr/bin/env bash
# The forty-fourth session's GPU calls: the forty-third's plan (../forty_third_session/README.md) fitted to 10-minute
# commands: `cal tests` in one call, then `b8` and `b8_gsm8k` (batch 8 only; batch 1 is the forty-second session's)
# with the table `cal` wrote, kept in tables/ beside this file. Usage, from the repository root, with fla-core's
# wheel in .whl/:   OUT=... bash results/speed_h200/forty_fourth_session/gpu.sh PART...
set -uo pipefail
HERE=results/speed_h200/forty_fourth_session
. eval/gpu_preamble.sh
install_tables results/speed_h200/thirty_eighth_session  # the H200's
[ -d $HERE/tables ] && install_tables $HERE  # this session's, once `cal` has run
for PART in "$@"; do
case $PART in
cal)  # the house model's closed-form table on this GPU
    STEP_SHOWS="^ +[0-9]|wrote|Error" STEP_TAIL=12 step cal "${CAL_S:-350}" python3 -m hf_bole.calibrate \
        --model eval/house/checkpoint --dtype bf16 --batch-sizes 1 4 8 16 --kv-lengths 1024 --reps 5 \
        --verify closed_form
    mkdir -p "$OUT/tables" && cp "$HF_BOLE_CACHE"/budgets/*closed_form*.json "$OUT/tables/"
    ;;
tests)  # on CUDA: the kept writes matching new stop-string criteria by equal tables, stop strings through generate
    HF_BOLE_TEST_DEVICE=cuda step tests "${TESTS_S:-220}" python3 -m pytest -v -p no:cacheprovider -rf --tb=short \
        tests/generation/test_loop.py tests/generation/test_budget.py -k "replayed_writes or stop_strings or auto"
    ;;
b8|b8_gsm8k)  # chain d10 against bole d10 at batch 8: the table ("auto"), the fallback's 248 and two narrower
    DATASET=mbpp
    [ "$PART" = b8_gsm8k ] && DATASET=gsm8k
    HOUSE_PROFILE= house_run "$PART" "${B8_S:-280}" $DATASET --modes chain bole --batch-sizes 8 --depth 10 \
        --chain-depth 10 --budget auto 96 160 248 --repeats "${REPEATS:-3}"
    ;;
*)
    echo "unknown part $PART"
    ;;
esac
done
