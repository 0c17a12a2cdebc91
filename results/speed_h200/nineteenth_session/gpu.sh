#!/usr/bin/env bash
# The next session's GPU calls, written at the end of the nineteenth (README.md beside this file says what is
# measured already). Each part fits one device command; by priority: next1, next2, next3, next4. Usage, from the
# repository root, with fla-core's wheel in .whl/:
#   OUT=... bash results/speed_h200/nineteenth_session/gpu.sh PART...   (parts in turn, on one machine)
set -uo pipefail
. eval/gpu_preamble.sh
for PART in "$@"; do
case $PART in
next1)  # issue 8's house targets at this tree (last measured in the seventh session: 1.09x chain at batch 1, 1.05x
        # tree-serial at batch 8), then the house round kernel by kernel: drafting was its largest phase
    STEP_SHOWS="^\| mbpp" STEP_TAIL=12 step house_targets 400 python3 eval/run.py --datasets mbpp \
        --modes ar chain tree-serial bole --batch-sizes 1 8 --num-prompts 8 --max-new-tokens 128 --profile \
        --interleave --output-dir "$OUT"
    STEP_SHOWS="bole|draft|verify" STEP_TAIL=20 step profile_house_b1 150 python3 eval/profile_round.py --modes bole \
        --batch-sizes 1 --num-prompts 1 --max-new-tokens 64 --top 20 --kernel-log "$OUT"
    gzip "$OUT"/kernels_*.tsv
    ;;
next2)  # the README's 9B batch-8 compiled row at this tree (tree attention): 2078.6 tokens/s, 2.56x ar-static, at
        # 18ff197; issue 8 asks for >= 2.0x
    STEP_SHOWS="^\||tokens/s|exact" STEP_TAIL=12 step speed9b_b8_compiled 560 python3 eval/run.py --shape 9B \
        --depth 6 --max-new-tokens 256 --modes ar-static bole --batch-sizes 8 --num-prompts 8 --budget 32 \
        --compile on --profile --interleave --output-dir "$OUT"
    ;;
next3)  # where the compiled 9B round's 6.23 ms go now (the seventeenth session's log had 6.76), then issue 2's two
        # target shapes against fla's chain
    step profile_9b_b1_compiled 330 python3 eval/profile_round.py --shape 9B --modes bole --compile on --depth 6 \
        --batch-sizes 1 --num-prompts 1 --max-new-tokens 64 --top 30 --json "$OUT/profile_9b_b1_compiled.json" \
        --kernel-log "$OUT"
    gzip "$OUT"/kernels_*.tsv
    STEP_SHOWS="^\|" STEP_TAIL=12 step bench_issue2 200 python3 eval/bench_kernels.py --shapes 32,16,128 48,1,128 \
        --providers fla bole --out "$OUT/kernels.jsonl"
    ;;
next4)  # the 9B batch-16 compiled row (2717.6 tokens/s, 1.87x ar-static at 18ff197, budget 64)
    STEP_SHOWS="^\||tokens/s|exact" STEP_TAIL=12 step speed9b_b16_compiled 560 python3 eval/run.py --shape 9B \
        --depth 6 --max-new-tokens 256 --modes ar-static bole --batch-sizes 16 --num-prompts 16 --budget 64 \
        --compile on --profile --interleave --output-dir "$OUT"
    ;;
*)
    echo "unknown part $PART (next1, next2, next3, next4)"
    ;;
esac
done
