#!/usr/bin/env bash
# The thirty-sixth session's GPU plan (README.md beside this file says why): the depth sweep again, now that every
# drafter compiles its rounds, then the CUDA tests the thirty-fourth session could not finish.
# Usage, from the repository root, with fla-core's wheel in .whl/:
#   OUT=... bash results/speed_h200/thirty_sixth_session/gpu.sh PART...   (parts in turn, on one machine)
# Budget tables: the thirty-third session's, format 4 (its tables/ folder), installed first.
set -uo pipefail
. eval/gpu_preamble.sh
mkdir -p "$HF_BOLE_CACHE/budgets"
cp results/speed_h200/thirty_third_session/tables/*.json "$HF_BOLE_CACHE/budgets/"
for PART in "$@"; do
case $PART in
depths8)  # every mode at the tables' budgets, batch 8, trees of depth 6, 8 and 10 and chains of 6 and 10, eight
          # passes in turns, unprofiled
    HOUSE_PROFILE= house_run depths8 "${DEPTHS_S:-560}" mbpp --modes ar chain tree-serial bole --batch-sizes 8 \
        --depth 6 8 10 --chain-depth 6 10 --repeats 8
    grep -c "recompile_limit" "$OUT/depths8.log"
    ;;
deep8)  # the least that answers the sweep's question: chain at its best depth (10) against bole and tree-serial at
        # 6 and 10, batch 8, eight passes in turns, unprofiled; three drafters to compile, not eight
    HOUSE_PROFILE= house_run deep8 "${DEEP_S:-420}" mbpp --modes chain tree-serial bole --batch-sizes 8 \
        --depth 6 10 --chain-depth 10 --repeats 8
    ;;
tests)  # on CUDA: the token writes' graphs, then the loop's pipelined rounds, first token and stop strings
    HF_BOLE_TEST_DEVICE=cuda step graph_tests "${GRAPH_TESTS_S:-60}" python3 -m pytest -q -p no:cacheprovider -rf \
        --tb=short tests/generation/test_graphs.py -k shape_graphs
    HF_BOLE_TEST_DEVICE=cuda step loop_tests "${LOOP_TESTS_S:-150}" python3 -m pytest -q -p no:cacheprovider -rf \
        --tb=short --durations=10 tests/generation/test_loop.py -k "pipelined or first_token or stop"
    ;;
*)
    echo "unknown part $PART"
    ;;
esac
done
