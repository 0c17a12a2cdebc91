#!/usr/bin/env bash
# The thirty-fifth session's GPU plan (README.md beside this file says why): deeper trees, the graphed token writes
# against eager ones, and the CUDA tests the thirty-fourth session could not finish.
# Usage, from the repository root, with fla-core's wheel in .whl/:
#   OUT=... bash results/speed_h200/thirty_fifth_session/gpu.sh PART...   (parts in turn, on one machine)
# Budget tables: the thirty-third session's, format 4 (its tables/ folder), installed first.
set -uo pipefail
. eval/gpu_preamble.sh
mkdir -p "$HF_BOLE_CACHE/budgets"
cp results/speed_h200/thirty_third_session/tables/*.json "$HF_BOLE_CACHE/budgets/"
for PART in "$@"; do
case $PART in
tests)  # on CUDA, one step each so that one running out of time leaves the others: the token writes' graphs
        # (captured behind queued work, one pool), then the loop's pipelined rounds (no wait, the pinned upload
        # included), the first token read behind the first round and the stop strings
    HF_BOLE_TEST_DEVICE=cuda step graph_tests "${GRAPH_TESTS_S:-90}" python3 -m pytest -q -p no:cacheprovider -rf \
        --tb=short tests/generation/test_graphs.py -k shape_graphs
    HF_BOLE_TEST_DEVICE=cuda step loop_tests "${LOOP_TESTS_S:-300}" python3 -m pytest -q -p no:cacheprovider -rf \
        --tb=short --durations=10 tests/generation/test_loop.py -k "pipelined or first_token or stop"
    ;;
depths8)  # every mode at the tables' budgets, batch 8, trees of depth 6, 8, 10 and 12 and chains of 3 to 12, ten
          # passes in turns, unprofiled
    HOUSE_PROFILE= house_run depths8 "${DEPTHS_S:-480}" mbpp --modes ar chain tree-serial bole --batch-sizes 8 \
        --depth 6 8 10 12 --chain-depth 3 6 8 10 12 --repeats 10
    ;;
depths1)  # the same at batch 1, five passes
    HOUSE_PROFILE= house_run depths1 "${DEPTHS_S:-480}" mbpp --modes ar chain tree-serial bole --batch-sizes 1 \
        --depth 6 8 10 12 --chain-depth 3 6 8 10 12 --repeats 5
    ;;
writes8)  # the token writes graphed against launched from Python, bole and tree-serial, batch 8, depth 6
    STEP_SHOWS="median|Error|error" STEP_TAIL=10 step writes8 "${WRITES_S:-300}" python3 \
        results/speed_h200/thirty_fourth_session/ab_before.py --datasets mbpp --num-prompts 8 --max-new-tokens 128 \
        --batch-sizes 8 --depth 6 --repeats 10 --output-dir "$OUT"
    ;;
*)
    echo "unknown part $PART"
    ;;
esac
done
