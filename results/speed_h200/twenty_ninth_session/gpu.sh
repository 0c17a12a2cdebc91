#!/usr/bin/env bash
# The twenty-ninth session's GPU runs (README.md beside this file says what each measured).
# Usage, from the repository root, with fla-core's wheel in .whl/:
#   OUT=... bash results/speed_h200/twenty_ninth_session/gpu.sh PART...   (parts in turn, on one machine)
# Every part reads the house model's tables that the twenty-seventh session calibrated (installed first).
set -uo pipefail
. eval/gpu_preamble.sh
mkdir -p "$HF_BOLE_CACHE/budgets"
cp results/speed_h200/twenty_seventh_session/tables/*.json "$HF_BOLE_CACHE/budgets/"
for PART in "$@"; do
case $PART in
depth_a|depth_b)  # issue 8's bole / tree-serial at batch 8 with the tree's depth swept too: each algorithm at its
                  # own best depth and budget (a: depths 5 and 7, b: 6 and 8; one process each, passes in turns)
    if [ "$PART" = depth_a ]; then DEPTHS="5 7"; BUDGETS="32 128 auto"; else DEPTHS="6 8"; BUDGETS="64 128 auto"; fi
    house_run "$PART" "${DEPTH_S:-540}" mbpp --modes tree-serial bole --batch-sizes 8 --depth $DEPTHS \
        --budget $BUDGETS
    ;;
profile)  # every kernel of one batch-8 call of bole at depth 5 and auto: what a drafting step launches now
    STEP_SHOWS="bole|draft|verify" STEP_TAIL=40 step profile "${PROFILE_S:-240}" python3 eval/profile_round.py \
        --datasets mbpp --num-prompts 8 --max-new-tokens 128 --batch-sizes 8 --modes bole --kernel-log "$OUT/kernels"
    gzip -f "$OUT"/kernels/*.tsv
    ;;
tests)  # the drafter's new kernels on CUDA (row_topk, masked_attention, their ops), then the drafter's tests there
    step kernel_tests "${TESTS_S:-150}" python3 -m pytest -q -p no:cacheprovider -rf --tb=short \
        tests/kernels/test_topk.py tests/kernels/test_attention.py tests/kernels/test_ops.py
    HF_BOLE_TEST_DEVICE=cuda step mtp_tests "${MTP_S:-150}" python3 -m pytest -q -p no:cacheprovider -rf --tb=short \
        tests/generation/test_mtp.py
    ;;
kernels_b8)  # issue 8 after the drafter's kernels: ar, chain, tree-serial and bole at batch 8, depth 6
    house_run kernels_b8 "${B8_S:-330}" mbpp --modes ar chain tree-serial bole --batch-sizes 8 --depth 6 \
        --budget 128 auto
    ;;
*)
    echo "unknown part $PART"
    ;;
esac
done
