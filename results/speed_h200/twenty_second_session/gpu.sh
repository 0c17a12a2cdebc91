#!/usr/bin/env bash
# The twenty-second session's GPU runs (README.md beside this file says what each measured).
# Usage, from the repository root, with fla-core's wheel in .whl/:
#   OUT=... bash results/speed_h200/twenty_second_session/gpu.sh PART...   (parts in turn, on one machine)
set -uo pipefail
. eval/gpu_preamble.sh
LAST=results/speed_h200/twenty_first_session
for PART in "$@"; do
case $PART in
measure)  # the drafter's attention on CUDA, the host time of graph launches, per-phase host/kernel/span, trim A/B
    HF_BOLE_TEST_DEVICE=cuda step mtp_attention 60 python3 -m pytest -q tests/generation/test_mtp.py \
        -k "few_queries or without_sdpa or whole_cache or cuda_graphs_match"
    STEP_SHOWS="^\||tokens/s" STEP_TAIL=12 step graph_launch 110 python3 $LAST/graph_launch.py \
        --datasets mbpp --num-prompts 8 --max-new-tokens 128 --batch-sizes 8
    STEP_SHOWS="^\|" STEP_TAIL=20 step profile_b8 120 python3 eval/profile_round.py --datasets mbpp --num-prompts 8 \
        --max-new-tokens 128 --batch-sizes 8 --modes tree-serial bole --json "$OUT/profile_b8.json"
    STEP_SHOWS="median|turn" STEP_TAIL=12 step ab_trim 250 python3 results/speed_h200/twenty_second_session/ab_trim.py \
        --datasets mbpp --num-prompts 8 --max-new-tokens 128 --batch-sizes 8 --repeats 5 --output-dir "$OUT"
    ;;
*)
    echo "unknown part $PART"
    ;;
esac
done
