#!/usr/bin/env bash
# The thirty-seventh session's GPU plan (README.md beside this file says what came of it): the thirty-sixth session's
# deep8 (deeper trees, every drafter compiled), batch 1 (bole against chain), the drafting graph's kernels, the
# attention merge's A/B, the session's drafter changes end to end (ab1, abc1: not yet run), and the CUDA tests.
# Usage, from the repository root, with fla-core's wheel in .whl/:
#   OUT=... bash results/speed_h200/thirty_seventh_session/gpu.sh PART...   (parts in turns, on one machine)
# Budget tables: the thirty-third session's, format 4 (its tables/ folder), installed first.
set -uo pipefail
. eval/gpu_preamble.sh
mkdir -p "$HF_BOLE_CACHE/budgets"
cp results/speed_h200/thirty_third_session/tables/*.json "$HF_BOLE_CACHE/budgets/"
for PART in "$@"; do
case $PART in
deep8)  # chain at its best depth (10) against bole and tree-serial at 6 and 10, batch 8, eight passes in turns
    HOUSE_PROFILE= house_run deep8 "${DEEP_S:-480}" mbpp --modes chain tree-serial bole --batch-sizes 8 \
        --depth 6 10 --chain-depth 10 --repeats 8
    ;;
b1)  # batch 1: chain at 6 and 10 against bole at 6 and 10 (issue 8: bole >= 1.2x chain), eight passes in turns
    HOUSE_PROFILE= house_run b1 "${B1_S:-300}" mbpp --modes chain bole --batch-sizes 1 --depth 6 10 \
        --chain-depth 6 10 --repeats 8
    ;;
b1g)  # batch 1 on GSM8K: chain at 6 and 10 against bole at 10, eight passes in turns
    HOUSE_PROFILE= house_run b1g "${B1G_S:-200}" gsm8k --modes chain bole --batch-sizes 1 --depth 10 \
        --chain-depth 6 10 --repeats 8
    ;;
prof1)  # batch 1, MBPP, with the phase timer: where chain's and bole's rounds go at depth 10, three passes
    house_run prof1 "${PROF1_S:-200}" mbpp --modes chain bole --batch-sizes 1 --depth 10 --chain-depth 10 --repeats 3
    ;;
kernels1)  # batch 1, depth 10: the drafting graph kernel by kernel (draft_kernels.py)
    STEP_SHOWS="====|^  |^    " STEP_TAIL=200 step kernels1 "${KERNELS1_S:-300}" python3 \
        results/speed_h200/thirty_seventh_session/draft_kernels.py --out "$OUT"
    ;;
merge)  # the attention merge a split a step against chunks of splits (merge_ab.py), then the attention tests on CUDA
    STEP_SHOWS="before|Error" STEP_TAIL=12 step merge_ab "${MERGE_S:-90}" python3 \
        results/speed_h200/thirty_seventh_session/merge_ab.py --out "$OUT/merge_ab.jsonl"
    step attention_tests "${ATTENTION_TESTS_S:-100}" python3 -m pytest -q -p no:cacheprovider -rf --tb=short \
        tests/kernels/test_attention.py
    ;;
ab1|abc1)  # batch 1, depth 10, bole (ab1) or chain (abc1): the session's two drafter changes against their forms
          # before, four variants in one process, passes in turns (ab_drafter.py); each variant compiles its drafter
    [ "$PART" = ab1 ] && SHAPE="--depth 10" || SHAPE="--depth 10 --topk 1 --budget 10"
    STEP_SHOWS="median|Error" STEP_TAIL=8 step "$PART" "${AB_S:-400}" python3 \
        results/speed_h200/thirty_seventh_session/ab_drafter.py --datasets mbpp --num-prompts 8 --max-new-tokens 128 \
        --batch-sizes 1 $SHAPE --repeats 20 --output-dir "$OUT/$PART"
    ;;
graph_tests)  # on CUDA: the token writes' graphs, the shared pool's growth among them
    HF_BOLE_TEST_DEVICE=cuda step graph_tests "${GRAPH_TESTS_S:-60}" python3 -m pytest -q -p no:cacheprovider -rf \
        --tb=short tests/generation/test_graphs.py -k shape_graphs
    ;;
loop_tests)  # on CUDA: the loop's pipelined rounds, first token and stop strings
    HF_BOLE_TEST_DEVICE=cuda step loop_tests "${LOOP_TESTS_S:-200}" python3 -m pytest -q -p no:cacheprovider -rf \
        --tb=short --durations=10 tests/generation/test_loop.py -k "pipelined or first_token or stop"
    ;;
*)
    echo "unknown part $PART"
    ;;
esac
done
