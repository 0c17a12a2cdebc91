#!/usr/bin/env bash
# The twenty-first session's GPU runs (README.md beside this file says what each measured).
# Usage, from the repository root, with fla-core's wheel in .whl/:
#   OUT=... bash results/speed_h200/twenty_first_session/gpu.sh PART...   (parts in turn, on one machine)
# At most 8 files come back from a device command, so each part keeps its output to a few. Call 1 also packed
# Triton's and inductor's on-disk caches after the compiled house run, to carry them to later fresh machines: 34 MiB
# gzipped, more than can travel beside the 35 MB checkout (64 MiB), so that was dropped.
set -uo pipefail
. eval/gpu_preamble.sh
ab() {  # ab NAME SECONDS ARGS...: the drafter before and after this session, passes in turns (ab_drafter.py)
    local name=$1 limit=$2
    shift 2
    STEP_SHOWS="median|turn" STEP_TAIL=12 step "$name" "$limit" python3 results/speed_h200/twenty_first_session/ab_drafter.py \
        --datasets mbpp --num-prompts 8 --max-new-tokens 128 --output-dir "$OUT/$name" "$@"
    rm -rf "${OUT:?}/$name"
}
for PART in "$@"; do
case $PART in
fixtest)  # the compiled-path fix (315dbd0) on the GPU: inductor over two KV capacities, every attention layer
    HF_BOLE_TEST_DEVICE=cuda step fixtest 120 python3 -m pytest -q -x tests/models/test_qwen3_5.py \
        -k "inductor_graph_with_the_capacity_symbolic or compiled"
    ;;
house_b1c)  # house, batch 1, compiled ar/chain/bole with the fix: issue 8's bole >= 1.2x chain at batch 1
    house_run house_b1_compiled 450 mbpp --modes ar chain bole --batch-sizes 1 --compile on
    ;;
house_b8c)  # house, batch 8, compiled chain/tree-serial/bole and ar: issue 8's bole >= 1.3x tree-serial
    house_run house_b8_compiled 450 mbpp --modes ar chain tree-serial bole --batch-sizes 8 --compile on
    ;;
drafter)  # call 4, on e41afd3: the drafter's attention and top-k on the GPU, then the house tables eager
    HF_BOLE_TEST_DEVICE=cuda step mtp_tests 100 python3 -m pytest -q tests/generation/test_mtp.py
    ab ab_b8 100 --batch-sizes 8 --repeats 5
    house_run house_b8_eager 130 mbpp --modes ar chain tree-serial bole --batch-sizes 8
    ab ab_b1 70 --batch-sizes 1 --repeats 7
    house_run house_b1_eager 100 mbpp --modes ar chain tree-serial bole --batch-sizes 1
    ;;
next1)  # the next session's first call: the host time of each graph launch (graph_launch.py), then the per-phase
        # table with host time beside kernels and span (profile_round.py as of this session), eager graphs, batch 8
    STEP_SHOWS="^\||tokens/s" STEP_TAIL=12 step graph_launch 150 python3 results/speed_h200/twenty_first_session/graph_launch.py \
        --datasets mbpp --num-prompts 8 --max-new-tokens 128 --batch-sizes 8
    STEP_SHOWS="^\|" STEP_TAIL=12 step profile_b8 150 python3 eval/profile_round.py --datasets mbpp --num-prompts 8 \
        --max-new-tokens 128 --batch-sizes 8 --modes tree-serial bole --json "$OUT/profile_b8.json"
    ab ab_b8 250 --batch-sizes 8 --repeats 5
    ;;
next2)  # the compiled house modes at batch 1 with this session's drafter (851.7 tokens/s and 1.29x chain before it)
    house_run house_b1_compiled 570 mbpp --modes ar chain bole --batch-sizes 1 --compile on
    ;;
next3)  # the README's 9B batch-8 compiled row with tree attention (2078.6 tokens/s, 2.56x ar-static at 18ff197)
    STEP_SHOWS="^\||tokens/s|exact" STEP_TAIL=12 step speed9b_b8_compiled 570 python3 eval/run.py --shape 9B \
        --depth 6 --max-new-tokens 256 --modes ar-static bole --batch-sizes 8 --num-prompts 8 --budget 32 \
        --compile on --profile --interleave --output-dir "$OUT/b8"
    rm -f "$OUT"/b8/*.png "$OUT"/b8/results.jsonl
    ;;
next4)  # batch 8 without the host read that cuts the verify forward to the widest row (ab_trim.py)
    STEP_SHOWS="median|turn" STEP_TAIL=12 step ab_trim 300 python3 results/speed_h200/twenty_first_session/ab_trim.py \
        --datasets mbpp --num-prompts 8 --max-new-tokens 128 --batch-sizes 8 --repeats 5 --output-dir "$OUT/ab_trim"
    ;;
*)
    echo "unknown part $PART"
    ;;
esac
done
