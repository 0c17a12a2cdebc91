#!/usr/bin/env bash
# Sixteenth session's GPU calls (README.md beside this file): the new tests on CUDA, then ab.py beside this file (each
# change against its absence, swapped inside one process, passes in turns) on the 9B shape and the house model; and
# prefill_probe.py. call1-call3 ran at 429880c (ab.py was ab_fuse.py then, its A/B "fuse").
# Usage, from the repository root, with fla-core's wheel in .whl/:
#   OUT=... bash results/speed_h200/sixteenth_session/gpu.sh PART
set -uo pipefail
PART=$1
. eval/gpu_preamble.sh
AB="python3 results/speed_h200/sixteenth_session/ab.py fuse --output-dir $OUT"
AB_PREFILL="python3 results/speed_h200/sixteenth_session/ab.py prefill --output-dir $OUT"
SHAPE9B="--shape 9B --depth 6 --max-new-tokens 256"
case $PART in
call1)
    step tests 120 env HF_BOLE_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider -rf --tb=short -n 4 \
        tests/models/test_fused.py tests/models/test_qwen3_5.py tests/generation/test_graphs.py -k "not two_gpus"
    step ab_9b_b1 160 $AB $SHAPE9B --batch-sizes 1 --num-prompts 2 --repeats 7
    step ab_9b_b8 160 $AB $SHAPE9B --batch-sizes 8 --num-prompts 8 --repeats 5
    ;;
call2)
    step tests 80 env HF_BOLE_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider -rf --tb=short -n 2 \
        tests/models/test_fused.py
    step ab_9b_b1_compiled 470 $AB $SHAPE9B --batch-sizes 1 --num-prompts 2 --repeats 5 --compile on
    ;;
call3)
    step prefill 120 python3 results/speed_h200/sixteenth_session/prefill_probe.py
    cat "$OUT/prefill.log" | grep -E "^P |H200"
    step ab_house_b1 150 $AB --datasets gsm8k --max-new-tokens 128 --batch-sizes 1 --num-prompts 4 --repeats 5
    step ab_house_b8 150 $AB --datasets gsm8k --max-new-tokens 128 --batch-sizes 8 --num-prompts 8 --repeats 5
    ;;
call4)
    step tests 110 env HF_BOLE_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider -rf --tb=short -n 4 \
        tests/generation/test_prefill.py tests/generation/test_loop.py -k "prefill or pipelined or plain_oracle"
    step ab_prefill_9b_b1_compiled 250 $AB_PREFILL $SHAPE9B --batch-sizes 1 --num-prompts 2 --repeats 7 --compile on
    step ab_prefill_9b_b8 150 $AB_PREFILL $SHAPE9B --batch-sizes 8 --num-prompts 8 --repeats 5
    ;;
next)  # for the next session: this session's last fix on CUDA (no device time was left), then issue 8's table row
    step tests 300 env HF_BOLE_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider -rf --tb=short -n 4 \
        tests/generation/test_prefill.py tests/models/test_fused.py tests/models/test_qwen3_5.py \
        tests/generation/test_loop.py -k "prefill or fresh_cache or fused or pipelined or plain_oracle or gemm"
    step speed9b_b1_compiled 280 python3 eval/run.py --shape 9B --depth 6 --max-new-tokens 256 --modes ar-static bole \
        --batch-sizes 1 --num-prompts 2 --compile on --output-dir "$OUT"
    ;;
esac
grep -h -A3 "new tokens" "$OUT"/ab_*.log
cd "$OUT" && tar czf logs.tgz *.log && rm -f *.log
