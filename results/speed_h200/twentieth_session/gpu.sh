#!/usr/bin/env bash
# The twentieth session's GPU runs and the next session's (README.md beside this file says what each measured).
# Usage, from the repository root, with fla-core's wheel in .whl/:
#   OUT=... bash results/speed_h200/twentieth_session/gpu.sh PART...   (parts in turn, on one machine)
# At most 8 files come back from a device command, so each part keeps its output to a few. On a fresh machine the
# compiled house modes compile for most of 6 minutes: give a compiled part a command of its own.
set -uo pipefail
. eval/gpu_preamble.sh
house() {  # house NAME SECONDS ARGS...: the house model on 8 MBPP prompts, 128 new tokens, passes in turns
    local name=$1 limit=$2
    shift 2
    STEP_SHOWS="^\| mbpp|NOT a tie" STEP_TAIL=30 step "$name" "$limit" python3 eval/run.py --datasets mbpp \
        --num-prompts 8 --max-new-tokens 128 --profile --interleave --output-dir "$OUT/$name" "$@"
    rm -f "$OUT/$name"/*.png
}
for PART in "$@"; do
case $PART in
call2)  # this session's call 2, on a machine warm from call 1 (150 and 89 s)
    house house_b1_compiled 250 --modes ar chain tree-serial bole --batch-sizes 1 --compile on
    house house_b8_eager 260 --modes ar chain tree-serial bole --batch-sizes 8
    ;;
call3)  # call 3: issue 2's two target shapes with the closed form's float32 products as 3xTF32 (the default) and
        # as one TF32 pass (40 s each warm; cold, more than 85), then the compiled house modes at batch 8 (cut at 251 s)
    for p in tf32x3 tf32; do
        STEP_SHOWS="^(32|48) |bole_bfloat16" STEP_TAIL=12 step "bench_$p" 140 python3 eval/bench_kernels.py \
            --shapes 32,16,128 48,1,128 --providers bole solve --precision $p --out "$OUT/kernels_$p.jsonl"
    done
    house house_b8_compiled 250 --modes chain tree-serial bole --batch-sizes 8 --compile on
    ;;
next1)  # the compiled house modes at batch 1 with write_tree_kv fixed (315dbd0): outputs should equal plain greedy
        # but for bf16 near-ties, as in the ninth session (5 of 8); issue 8 asks bole >= 1.2x chain
    house house_b1_compiled 570 --modes ar chain bole --batch-sizes 1 --compile on
    ;;
next2)  # the same at batch 8 with tree-serial (issue 8: bole >= 1.3x tree-serial; eager this session: 1.10x)
    house house_b8_compiled 570 --modes ar chain tree-serial bole --batch-sizes 8 --compile on
    ;;
next3)  # the whole kernel grid in one TF32 pass, for issue 2's "no slower than fla's chain at every shape"
    STEP_SHOWS="^(32|48|64) |bole_bfloat16" STEP_TAIL=40 step bench_tf32_grid 500 python3 eval/bench_kernels.py \
        --providers fla bole --precision tf32 --out "$OUT/kernels_tf32_grid.jsonl"
    ;;
next4)  # the README's 9B batch-8 compiled row with tree attention (2078.6 tokens/s, 2.56x ar-static at 18ff197)
    STEP_SHOWS="^\||tokens/s|exact" STEP_TAIL=12 step speed9b_b8_compiled 570 python3 eval/run.py --shape 9B \
        --depth 6 --max-new-tokens 256 --modes ar-static bole --batch-sizes 8 --num-prompts 8 --budget 32 \
        --compile on --profile --interleave --output-dir "$OUT/b8"
    rm -f "$OUT"/b8/*.png
    ;;
next5)  # the batch-16 compiled row (2717.6 tokens/s, 1.87x ar-static at 18ff197, budget 64)
    STEP_SHOWS="^\||tokens/s|exact" STEP_TAIL=12 step speed9b_b16_compiled 570 python3 eval/run.py --shape 9B \
        --depth 6 --max-new-tokens 256 --modes ar-static bole --batch-sizes 16 --num-prompts 16 --budget 64 \
        --compile on --profile --interleave --output-dir "$OUT/b16"
    rm -f "$OUT"/b16/*.png
    ;;
*)
    echo "unknown part $PART (call2, call3, next1 ... next5)"
    ;;
esac
done
