#!/usr/bin/env bash
# The twenty-sixth session's GPU runs (README.md beside this file says what each measured).
# Usage, from the repository root, with fla-core's wheel in .whl/:
#   OUT=... bash results/speed_h200/twenty_sixth_session/gpu.sh PART...   (parts in turn, on one machine)
set -uo pipefail
. eval/gpu_preamble.sh
for PART in "$@"; do
case $PART in
tests)  # the round's tail from graphs: the graph tests and the loop's tests on CUDA
    HF_BOLE_TEST_DEVICE=cuda step tests 240 python3 -m pytest -q -x tests/generation/test_graphs.py \
        tests/generation/test_loop.py
    ;;
ab_b1)  # the tail replayed against launched from Python, one process
    STEP_SHOWS="median|Error" STEP_TAIL=8 step ab_b1 150 python3 results/speed_h200/twenty_sixth_session/ab_tail.py \
        --datasets mbpp --num-prompts 8 --max-new-tokens 128 --batch-sizes 1 --repeats 3 --output-dir "$OUT/ab"
    ;;
ab_b8)
    STEP_SHOWS="median|Error" STEP_TAIL=8 step ab_b8 250 python3 results/speed_h200/twenty_sixth_session/ab_tail.py \
        --datasets mbpp --num-prompts 8 --max-new-tokens 128 --batch-sizes 8 --repeats 3 --output-dir "$OUT/ab"
    ;;
mbpp_b8)  # the README's MBPP batch-8 house rows
    house_run mbpp_b8 130 mbpp --modes ar chain tree-serial bole --batch-sizes 8
    ;;
*)
    echo "unknown part $PART"
    ;;
esac
done
