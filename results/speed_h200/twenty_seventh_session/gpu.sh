#!/usr/bin/env bash
# The twenty-seventh session's GPU runs (README.md beside this file says what each measured).
# Usage, from the repository root, with fla-core's wheel in .whl/:
#   OUT=... bash results/speed_h200/twenty_seventh_session/gpu.sh PART...   (parts in turn, on one machine)
# Budget tables: `calibrate` writes them to $HF_BOLE_CACHE/budgets and $OUT; the parts after it, on a later machine,
# first copy this folder's tables/ there.
set -uo pipefail
. eval/gpu_preamble.sh
HERE=results/speed_h200/twenty_seventh_session
mkdir -p "$HF_BOLE_CACHE/budgets"
cp "$HERE"/tables/*.json "$HF_BOLE_CACHE/budgets/" 2>/dev/null
NODES="0 8 16 32 64 96 128 192 256 384 512"
for PART in "$@"; do
case $PART in
tests)  # the round's tail from graphs (86690ce): the graph and loop tests on CUDA
    HF_BOLE_TEST_DEVICE=cuda step tests 250 python3 -m pytest -q -n 4 -p no:cacheprovider -rf --tb=short \
        tests/generation/test_graphs.py tests/generation/test_loop.py
    ;;
calibrate)  # the house model's tables, closed form and serial verify (each mode reads its own)
    STEP_SHOWS="^ +[0-9]|wrote|Error" STEP_TAIL=12 step cal_closed 200 python3 -m hf_bole.calibrate \
        --model eval/house/checkpoint --dtype bf16 --batch-sizes 1 4 8 16 --kv-lengths 1024 --nodes $NODES --reps 5 \
        --out "$OUT/house_closed_form.json"
    STEP_SHOWS="^ +[0-9]|wrote|Error" STEP_TAIL=12 step cal_serial 120 python3 -m hf_bole.calibrate \
        --model eval/house/checkpoint --dtype bf16 --batch-sizes 1 8 --kv-lengths 1024 --nodes $NODES --reps 5 \
        --verify serial --out "$OUT/house_serial.json"
    ;;
mbpp_b1)  # the README's MBPP house rows, with the tables
    house_run mbpp_b1 150 mbpp --modes ar chain tree-serial bole --batch-sizes 1
    ;;
mbpp_b8)
    house_run mbpp_b8 180 mbpp --modes ar chain tree-serial bole --batch-sizes 8
    ;;
sweep)  # issue 5 on the house model: fixed budgets against the table's, passes in turns
    STEP_SHOWS="^\| gsm8k" STEP_TAIL=40 step sweep 300 python3 eval/run.py --datasets gsm8k --modes bole \
        --batch-sizes 16 8 4 1 --num-prompts 16 --max-new-tokens 96 --budget 16 32 64 128 256 512 auto --repeats 4 \
        --interleave --output-dir "$OUT/sweep"
    rm -f "$OUT/sweep"/*.png "$OUT/sweep"/results.jsonl "$OUT/sweep"/run.log
    ;;
sweep2)  # the same after the look-up's line between batch buckets and epsilon 0.3 (the new defaults)
    STEP_SHOWS="^\| gsm8k" STEP_TAIL=40 step sweep2 300 python3 eval/run.py --datasets gsm8k --modes bole \
        --batch-sizes 16 8 4 1 --num-prompts 16 --max-new-tokens 96 --budget 32 128 256 auto --repeats 3 \
        --interleave --output-dir "$OUT/sweep2"
    rm -f "$OUT/sweep2"/*.png "$OUT/sweep2"/results.jsonl "$OUT/sweep2"/run.log
    ;;
*)
    echo "unknown part $PART"
    ;;
esac
done
