#!/usr/bin/env bash
# The thirty-fourth session's GPU runs (README.md beside this file says what each measured).
# Usage, from the repository root, with fla-core's wheel in .whl/ and the earlier loop in results/raw/ (ab_before.py):
#   OUT=... bash results/speed_h200/thirty_fourth_session/gpu.sh PART...   (parts in turn, on one machine)
# Budget tables: the thirty-third session's, format 4 (its tables/ folder), installed first.
set -uo pipefail
. eval/gpu_preamble.sh
HERE=results/speed_h200/thirty_fourth_session
mkdir -p "$HF_BOLE_CACHE/budgets"
cp results/speed_h200/thirty_third_session/tables/*.json "$HF_BOLE_CACHE/budgets/"
for PART in "$@"; do
case $PART in
tests)  # on CUDA: the token writes' graphs (captured behind queued work, one pool), replayed generate against plain,
        # pipelined rounds wait for nothing (the active rows' upload included), the first token read behind the first
        # round, the row cap, stop strings
    HF_BOLE_TEST_DEVICE=cuda step graph_tests "${GRAPH_TESTS_S:-120}" python3 -m pytest -q -p no:cacheprovider -rf \
        --tb=short tests/generation/test_graphs.py -k "shape_graphs or cuda_graphs_generate"
    HF_BOLE_TEST_DEVICE=cuda step loop_tests "${LOOP_TESTS_S:-150}" python3 -m pytest -q -p no:cacheprovider -rf \
        --tb=short tests/generation/test_loop.py -k "pipelined or first_token or capped or stop"
    ;;
anatomy)  # a whole call's time: transformers' preparation, set-up and prefill, rounds, after; GPU busy and idle
    STEP_SHOWS="====|per call|host |^    " STEP_TAIL=60 step anatomy "${ANATOMY_S:-240}" python3 "$HERE/anatomy.py" \
        --calls 10 --out "$OUT"
    ;;
before8)  # this checkout's loop against 1b0b240's (and with its token writes launched from Python), bole and
          # tree-serial at the tables' budgets, batch 8, ten passes in turns, no phase timer
    STEP_SHOWS="median|Error|error" STEP_TAIL=10 step before8 "${BEFORE_S:-300}" python3 "$HERE/ab_before.py" \
        --datasets mbpp --num-prompts 8 --max-new-tokens 128 --batch-sizes 8 --depth 6 --repeats 10 \
        --before results/raw/loop_1b0b240.py --output-dir "$OUT"
    ;;
floor1)  # every mode at the tables' budgets ("auto"), batch 1, depth 6, five passes in turns (needs ~220 s)
    house_run floor1 "${FLOOR_S:-260}" mbpp --modes ar chain tree-serial bole --batch-sizes 1 --repeats 5 --depth 6
    ;;
floor8)  # the same at batch 8, ten passes
    house_run floor8 "${FLOOR_S:-240}" mbpp --modes ar chain tree-serial bole --batch-sizes 8 --repeats 10 --depth 6
    ;;
depths8)  # tree-serial and bole at their tables ("auto"), depths 6, 7 and 8, batch 8, ten passes in turns
    house_run depths8 "${DEPTHS_S:-420}" mbpp --modes tree-serial bole --batch-sizes 8 --depth 6 7 8 --repeats 10
    ;;
*)
    echo "unknown part $PART"
    ;;
esac
done
