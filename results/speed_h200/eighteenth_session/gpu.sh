#!/usr/bin/env bash
# Eighteenth session's GPU calls, written without a GPU (no device was lent this session) for the next one to run
# (README.md beside this file). Usage, from the repository root, with fla-core's wheel in .whl/:
#   OUT=... bash results/speed_h200/eighteenth_session/gpu.sh PART...   (parts in turn, on one machine)
set -uo pipefail
. eval/gpu_preamble.sh
for PART in "$@"; do
case $PART in
call1)  # the new kernels on CUDA (attention, round masks, ancestors, KV move): their tests and the code around them,
        # then the attention bench against what runs today
    step kernel_tests 90 python3 -m pytest -q -p no:cacheprovider -rf --tb=short -n 4 tests/kernels/test_attention.py \
        tests/kernels/test_tree_masks.py tests/kernels/test_ancestors.py tests/kernels/test_ops.py tests/kernels/test_kv_move.py
    step model_tests 170 env HF_BOLE_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider -rf --tb=short -n 4 \
        tests/cache/test_bole_cache.py tests/models/test_qwen3_5.py tests/generation/test_loop.py tests/generation/test_graphs.py \
        -k "attention or commit or tree_forward or one_graph or plain_oracle or pipelined or replayed"
    STEP_SHOWS="^\|" STEP_TAIL=30 step bench_attention 120 python3 eval/bench_attention.py --shapes 9B \
        --out "$OUT/attention.jsonl"
    ;;
call2)  # the 9B row A/B (CUDA graphs, eager forward) of bole_attention="model" against "triton", in one process
    STEP_SHOWS="median|exact" STEP_TAIL=4 step ab_attention_9b_b1 200 python3 -c "import sys; sys.path.insert(0, '.')
from eval import ab_turns
ab_turns.main('attention', {'model': lambda m: {'bole_attention': 'model'}, 'triton': lambda m: {'bole_attention': 'triton'}})" \
        --shape 9B --depth 6 --max-new-tokens 256 --modes bole --batch-sizes 1 --num-prompts 2 --repeats 5 \
        --output-dir "$OUT"
    ;;
call3)  # issue 8's 9B row, compiled, against ar-static in one run, with the attention the A/B of call 2 chose
    ATTENTION=${ATTENTION:-triton}
    STEP_SHOWS="^\||tokens/s|exact" STEP_TAIL=12 step speed9b_b1_compiled 545 python3 eval/run.py --shape 9B --depth 6 \
        --max-new-tokens 256 --modes ar-static bole --batch-sizes 1 --num-prompts 2 --compile on --profile --interleave \
        --attention "$ATTENTION" --output-dir "$OUT"
    ;;
esac
done
