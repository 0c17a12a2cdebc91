#!/usr/bin/env bash
# The forty-third session's GPU plan, not run in that session (73 s of device time were left): README.md beside this
# file says why each part. Usage, from the repository root, with fla-core's wheel in .whl/:
#   OUT=... bash results/speed_h200/forty_third_session/gpu.sh PART...   (parts in turns, on one machine)
set -uo pipefail
. eval/gpu_preamble.sh
install_tables results/speed_h200/thirty_eighth_session  # the H200's; on an H100 `cal` measures that GPU's own
for PART in "$@"; do
case $PART in
tests)  # on CUDA: the kept writes matching new stop-string criteria by equal tables, stop strings through generate
    HF_BOLE_TEST_DEVICE=cuda step tests "${TESTS_S:-240}" python3 -m pytest -v -p no:cacheprovider -rf --tb=short \
        tests/generation/test_loop.py tests/generation/test_budget.py -k "replayed_writes or stop_strings or auto"
    ;;
cal)  # the house model's closed-form table on this GPU (the forty-second session's H100 runs had none: fallback)
    STEP_SHOWS="^ +[0-9]|wrote|Error" STEP_TAIL=12 step cal "${CAL_S:-220}" python3 -m hf_bole.calibrate \
        --model eval/house/checkpoint --dtype bf16 --batch-sizes 1 4 8 16 --kv-lengths 1024 --reps 5 \
        --verify closed_form
    mkdir -p "$OUT/tables" && cp "$HF_BOLE_CACHE"/budgets/*closed_form*.json "$OUT/tables/"
    ;;
b8|b8_gsm8k)  # after cal: chain d10 against bole d10 at the table ("auto"), the fallback's 248 and two narrower
              # budgets, batch 1 and 8, passes in turns
    DATASET=mbpp
    [ "$PART" = b8_gsm8k ] && DATASET=gsm8k
    HOUSE_PROFILE= house_run "$PART" "${B8_S:-420}" $DATASET --modes chain bole --batch-sizes 1 8 --depth 10 \
        --chain-depth 10 --budget auto 96 160 248 --repeats "${REPEATS:-3}"
    ;;
*)
    echo "unknown part $PART"
    ;;
esac
done
