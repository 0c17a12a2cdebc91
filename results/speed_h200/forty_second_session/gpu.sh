#!/usr/bin/env bash
# The forty-second session's GPU plan (README.md beside this file says what came of it). Both held-back patches
# (../fortieth_session/commit_graphs.patch, ../forty_first_session/kept_writes.patch) applied to the working tree.
# Usage, from the repository root, with fla-core's wheel in .whl/:
#   OUT=... bash results/speed_h200/forty_second_session/gpu.sh PART...   (parts in turns, on one machine)
set -uo pipefail
. eval/gpu_preamble.sh
install_tables results/speed_h200/thirty_eighth_session
for PART in "$@"; do
case $PART in
tests)  # on CUDA: the chains' replayed commits, the kept token writes, graphed generate over calls
    HF_BOLE_TEST_DEVICE=cuda step tests "${TESTS_S:-360}" python3 -m pytest -v -p no:cacheprovider -rf --tb=short \
        --durations=8 tests/generation/test_prefill.py tests/generation/test_graphs.py tests/generation/test_loop.py \
        -k "test_prefill or shape_graphs or generate_matches or replayed_writes or prefill_chains"
    ;;
static|static_gsm8k)  # issue 8's baseline in full on the house model: `ar` and `ar-static` (static cache,
                     # compiled by transformers) beside chain d10 and bole d10 ("auto" budget), MBPP (or GSM8K),
                     # batch 1 and 8, passes in turns
    DATASET=mbpp
    [ "$PART" = static_gsm8k ] && DATASET=gsm8k
    HOUSE_PROFILE= house_run "$PART" "${STATIC_S:-420}" $DATASET --modes ar ar-static chain bole --batch-sizes 1 8 \
        --depth 10 --chain-depth 10 --repeats "${REPEATS:-3}"
    ;;
*)
    echo "unknown part $PART"
    ;;
esac
done
