#!/usr/bin/env bash
# Seventeenth session's GPU calls (README.md beside this file). Usage, from the repository root, with fla-core's
# wheel in .whl/:
#   OUT=... bash results/speed_h200/seventeenth_session/gpu.sh PART
set -uo pipefail
PART=$1
. eval/gpu_preamble.sh
DIR=results/speed_h200/seventeenth_session
case $PART in
call1)  # the skinny GEMM against cuBLAS; last session's fix and the new kernel on CUDA (the kernel, its bench and its
        # tests sat in hf_bole/kernels/, eval/ and tests/kernels/ then; only the kernel and its bench were kept, here)
    STEP_SHOWS="^\||ceiling" STEP_TAIL=40 step gemm9b 150 python3 $DIR/bench_gemm.py --shape 9B --rows 8 16 32 64 \
        --output "$OUT/gemm9b.jsonl"
    STEP_SHOWS="^\|" STEP_TAIL=10 step gemm27b 60 python3 $DIR/bench_gemm.py --shape 27B --rows 32 --output "$OUT/gemm27b.jsonl"
    step tests 240 env HF_BOLE_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider -rf --tb=short -n 4 \
        tests/generation/test_prefill.py tests/models/test_qwen3_5.py \
        tests/generation/test_loop.py -k "skinny or split_k or prefill or fresh_cache or pipelined or plain_oracle"
    ;;
call2)  # the compiled 9B round kernel by kernel, on main's code with fused projections and chains
    step profile_9b_b1_compiled 420 python3 eval/profile_round.py --shape 9B --modes bole --compile on --depth 6 \
        --batch-sizes 1 --num-prompts 1 --max-new-tokens 64 --top 30 --json "$OUT/profile_9b_b1_compiled.json" \
        --kernel-log "$OUT"
    tail -30 "$OUT/profile_9b_b1_compiled.log"
    gzip "$OUT"/kernels_*.tsv
    ;;
call3)  # this session's changes: their CUDA tests, then issue 8's 9B row, compiled, against ar-static in one run
    step tests 120 env HF_BOLE_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider -rf --tb=short -n 4 \
        tests/cache/test_bole_cache.py tests/models/test_qwen3_5.py -k "transient or compile or fresh_cache or tree_forward"
    STEP_SHOWS="^\||tokens/s|exact" STEP_TAIL=12 step speed9b_b1_compiled 330 python3 eval/run.py --shape 9B --depth 6 \
        --max-new-tokens 256 --modes ar-static bole --batch-sizes 1 --num-prompts 2 --compile on --profile --interleave --output-dir "$OUT"
    ;;
next1)  # for the next session: the compiled round's kernels again (are the stacked-buffer copies gone on the GPU?)
    step profile_9b_b1_compiled 300 python3 eval/profile_round.py --shape 9B --modes bole --compile on --depth 6 \
        --batch-sizes 1 --num-prompts 1 --max-new-tokens 64 --top 30 --json "$OUT/profile_9b_b1_compiled.json" \
        --kernel-log "$OUT"
    gzip "$OUT"/kernels_*.tsv
    ;;
next2)  # then issue 8's row against ar-static, with room for both compiles (call3's 330 s were not enough)
    STEP_SHOWS="^\||tokens/s|exact" STEP_TAIL=12 step speed9b_b1_compiled 560 python3 eval/run.py --shape 9B --depth 6 \
        --max-new-tokens 256 --modes ar-static bole --batch-sizes 1 --num-prompts 2 --compile on --profile --interleave \
        --output-dir "$OUT"
    ;;
esac
cd "$OUT" && tar czf logs.tgz *.log && rm -f *.log
