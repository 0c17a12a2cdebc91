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
trim)  # Trim against a cut every round: CUDA tests, house batch 8, the 9B shape at batch 8 and a budget of 32, eager
    HF_BOLE_TEST_DEVICE=cuda step cuda_tests 100 python3 -m pytest -q -x tests/generation/test_graphs.py \
        tests/generation/test_mtp.py -k "trim or cuda_graphs_generate or few_queries or without_sdpa or whole_cache"
    STEP_SHOWS="median|turn" STEP_TAIL=12 step ab_trim_house 100 python3 results/speed_h200/twenty_second_session/ab_trim.py \
        --datasets mbpp --num-prompts 8 --max-new-tokens 128 --batch-sizes 8 --repeats 5 --output-dir "$OUT"
    STEP_SHOWS="median|turn" STEP_TAIL=12 step ab_trim_9b 200 python3 results/speed_h200/twenty_second_session/ab_trim.py \
        --shape 9B --depth 6 --budget 32 --max-new-tokens 256 --num-prompts 8 --batch-sizes 8 --repeats 3 --output-dir "$OUT"
    ;;
house)  # the README's eager house rows (MBPP, batches 1 and 8) with Trim, beside chain and tree-serial
    house_run house 250 mbpp --modes ar chain tree-serial bole --batch-sizes 1 8
    ;;
final)  # the fixed Trim test on CUDA, the house A/B again on warm caches, the GSM8K house rows, graph launch times
    HF_BOLE_TEST_DEVICE=cuda step cuda_tests 80 python3 -m pytest -q -x tests/generation/test_graphs.py -k "trim or cuda_graphs_generate"
    STEP_SHOWS="median|turn" STEP_TAIL=12 step ab_trim_house 150 python3 results/speed_h200/twenty_second_session/ab_trim.py \
        --datasets mbpp --num-prompts 8 --max-new-tokens 128 --batch-sizes 8 --repeats 5 --output-dir "$OUT"
    house_run house_gsm8k 230 gsm8k --modes ar chain tree-serial bole --batch-sizes 1 8
    rm -f "$OUT"/*.jsonl
    STEP_SHOWS="^\||tokens/s" STEP_TAIL=12 step graph_launch 120 python3 $LAST/graph_launch.py \
        --datasets mbpp --num-prompts 8 --max-new-tokens 128 --batch-sizes 8
    ;;
depth_b8)  # which depth and budget pay at batch 8: drafting costs by its steps (one MTP forward a level, launch
           # bound), chain's three steps took half of bole's five (call 2), and chain outran bole at batch 8 on MBPP
    house_run depth_b8 500 mbpp --modes chain bole --depth 4 5 6 --budget 32 64 128 --batch-sizes 8
    ;;
prefill)  # the house prompts (about 900 tokens) prefilled as chains against "auto"'s eager forward, batches 8 and 1
    STEP_SHOWS="median|turn" STEP_TAIL=12 step ab_prefill_b8 200 python3 results/speed_h200/twenty_second_session/ab_prefill.py \
        --datasets mbpp --num-prompts 8 --max-new-tokens 128 --batch-sizes 8 --repeats 5 --output-dir "$OUT"
    STEP_SHOWS="median|turn" STEP_TAIL=12 step ab_prefill_b1 150 python3 results/speed_h200/twenty_second_session/ab_prefill.py \
        --datasets mbpp --num-prompts 8 --max-new-tokens 128 --batch-sizes 1 --repeats 5 --output-dir "$OUT"
    ;;
*)
    echo "unknown part $PART"
    ;;
esac
done
