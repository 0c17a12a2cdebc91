#!/usr/bin/env bash
# Fifteenth session's GPU calls (README.md beside this file): pipelined rounds on CUDA, tests, then ab_pipeline.py
# beside this file (pipelined rounds against rounds one after the other, swapped inside one process, passes in turns)
# on the house model and the 9B shape. call1 ran at 6dc795c, call2-call4 at a2711c4, call5 at the tests' last form.
# Usage, from the repository root, with fla-core's wheel in .whl/:
#   OUT=... bash results/speed_h200/fifteenth_session/gpu.sh PART
set -uo pipefail
PART=$1
. eval/gpu_preamble.sh
AB="python3 results/speed_h200/fifteenth_session/ab_pipeline.py --output-dir $OUT"
SHAPE9B="--shape 9B --depth 6 --max-new-tokens 256"
case $PART in
call1)
    step tests 160 env HF_BOLE_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider -rf --tb=short -n 8 \
        tests/generation/test_loop.py tests/generation/test_mtp.py tests/generation/test_graphs.py \
        tests/generation/test_select_kernel.py tests/cache/test_bole_cache.py \
        tests/eval/test_run.py::test_oracle_drafter_acceptance tests/eval/test_run.py::test_oracle_tree_levels \
        -k "not compiled and not two_gpus"
    step ab_house_b1 110 $AB --datasets gsm8k --max-new-tokens 128 --batch-sizes 1 --num-prompts 4 --repeats 5
    step ab_house_b8 110 $AB --datasets gsm8k --max-new-tokens 128 --batch-sizes 8 --num-prompts 8 --repeats 5
    step ab_9b_b1 170 $AB $SHAPE9B --batch-sizes 1 --num-prompts 2 --repeats 7
    ;;
call2)
    step tests 120 env HF_BOLE_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider -rf --tb=short -n 8 \
        tests/generation/test_loop.py -k "pipelined or wait_for_the_gpu or oracle or stopping"
    step ab_9b_b1 150 $AB $SHAPE9B --batch-sizes 1 --num-prompts 2 --repeats 7
    step ab_9b_b8 140 $AB $SHAPE9B --batch-sizes 8 --num-prompts 8 --repeats 5
    step ab_house_b1 150 $AB --datasets gsm8k --max-new-tokens 128 --batch-sizes 1 --num-prompts 4 --repeats 5
    ;;
call3)
    step ab_9b_b1_compiled 540 $AB $SHAPE9B --batch-sizes 1 --num-prompts 2 --repeats 5 --compile on
    ;;
call4)
    step tests 240 env HF_BOLE_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider -rf --tb=short -n 4 \
        tests/generation/test_loop.py -k "pipelined or wait_for_the_gpu or greedy_matches_plain_oracle"
    step ab_9b_b8_compiled 250 $AB $SHAPE9B --batch-sizes 8 --num-prompts 8 --repeats 3 --compile on
    ;;
call5)
    step tests 150 env HF_BOLE_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider -rf --tb=short -n 2 \
        tests/generation/test_loop.py -k "wait_for_the_gpu"
    ;;
esac
grep -h -A3 "new tokens" "$OUT"/ab_*.log
cd "$OUT" && tar czf logs.tgz *.log && rm -f *.log
