#!/usr/bin/env bash
# The thirty-second session's GPU runs (README.md beside this file says what each measured).
# Usage, from the repository root, with fla-core's wheel in .whl/:
#   OUT=... bash results/speed_h200/thirty_second_session/gpu.sh PART...   (parts in turn, on one machine)
# Budget tables: format 3 (T_dec is the forward of selection's floor). `calibrate` measures them and copies them
# (named by their keys) to $OUT/tables; a later call installs the copies kept in tables/ beside this file.
set -uo pipefail
. eval/gpu_preamble.sh
HERE=results/speed_h200/thirty_second_session
mkdir -p "$HF_BOLE_CACHE/budgets"
ls "$HERE"/tables/*.json >/dev/null 2>&1 && cp "$HERE"/tables/*.json "$HF_BOLE_CACHE/budgets/"
NODES="0 8 16 32 64 96 128 192 256 384 512"
for PART in "$@"; do
case $PART in
calibrate)  # the house tables, closed form (batches 1, 4, 8, 16) and serial verify (1, 8), KV 1024, 5 repetitions
    for verify in closed_form serial; do
        batches="1 4 8 16"
        [ $verify = serial ] && batches="1 8"
        STEP_SHOWS="^ +[0-9]|wrote|Error" STEP_TAIL=12 step "cal_$verify" "${CAL_S:-300}" python3 -m hf_bole.calibrate \
            --model eval/house/checkpoint --dtype bf16 --batch-sizes $batches --kv-lengths 1024 --nodes $NODES \
            --reps 5 --verify $verify --plot "/tmp/cal_$verify.png"
    done
    mkdir -p "$OUT/tables" && cp "$HF_BOLE_CACHE"/budgets/*.json "$OUT/tables/"
    ;;
floor1)  # every mode at the tables' budgets ("auto"), batch 1, depth 6, five passes in turns
    house_run floor1 "${FLOOR_S:-240}" mbpp --modes ar chain tree-serial bole --batch-sizes 1 --repeats 5 --depth 6
    ;;
floor8)  # the same at batch 8, ten passes
    house_run floor8 "${FLOOR_S:-240}" mbpp --modes ar chain tree-serial bole --batch-sizes 8 --repeats 10 --depth 6
    ;;
sweep8)  # issue 8's ratio: tree-serial and bole at budgets 64, 128 and 256, batch 8, depth 6, ten passes in turns
    house_run sweep8 "${SWEEP_S:-300}" mbpp --modes tree-serial bole --batch-sizes 8 --depth 6 --budget 64 128 256 \
        --repeats 10
    ;;
tests)  # the rotary kernel on CUDA (the kernel tests pick their device), then the verify forward's swapped rotary
        # embeddings, norms and the tree forward with every model on the GPU
    step kernel_tests "${TESTS_S:-60}" python3 -m pytest -q -p no:cacheprovider -rf --tb=short \
        tests/kernels/test_rotary.py tests/kernels/test_rmsnorm.py
    HF_BOLE_TEST_DEVICE=cuda step model_tests "${MODEL_TESTS_S:-120}" python3 -m pytest -q -p no:cacheprovider -rf \
        --tb=short tests/models/test_rotary_fused.py tests/models/test_norms.py tests/models/test_qwen3_5.py
    ;;
abrot8)  # the rotary kernel against transformers' elementwise form, house model, batch 8, budget "auto", in turns
    STEP_SHOWS="median|Error|error" STEP_TAIL=8 step abrot8 "${ABROT_S:-200}" python3 "$HERE/ab_rotary.py" \
        --datasets mbpp --num-prompts 8 --max-new-tokens 128 --batch-sizes 8 --depth 6 --repeats 10 --output-dir "$OUT"
    ;;
abrot9b)  # the same on the random 9B shape (eight attention layers), oracle drafter, batch 1, depth 6, 32 nodes
    STEP_SHOWS="median|Error|error" STEP_TAIL=8 step abrot9b "${ABROT9_S:-260}" python3 "$HERE/ab_rotary.py" \
        --shape 9B --num-prompts 2 --max-new-tokens 256 --batch-sizes 1 --depth 6 --budget 32 --repeats 5 \
        --output-dir "$OUT"
    ;;
*)
    echo "unknown part $PART"
    ;;
esac
done
