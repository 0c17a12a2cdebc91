#!/usr/bin/env bash
# On nvidia-h200-x2 (issue 6): hf_bole with one model spread over both GPUs by accelerate's device_map.
#   tests    the device-map tests on CUDA: a tiny model split over cuda:0 and cuda:1 decodes with hf_bole (oracle and
#            MTP drafters) exactly as plain greedy generate, each layer's state on its own GPU; placement and settings
#   eval122  the real-shape 122B-A10B (random bf16 weights, 227 GiB) built across both GPUs (eval/shapes.py
#            build_model_across: each GPU an even share plus 8%, at least 8 GiB left for activations and the cache),
#            ar against bole at batch 1 and 8, oracle drafter at ~4 tokens per round (depth 6, accept 0.8)
# Each step has its own time limit (110 + 300 s: under 7 minutes together) and writes its log under $OUT (default
# results/gpu_devmap); the harness's table and rows are copied there (the rows finished so far if it is cut short).
set -uo pipefail
OUT=${OUT:-results/gpu_devmap}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_BOLE_CACHE=${HF_BOLE_CACHE:-/tmp/hf_bole_cache}
# fla-core, when carried in .whl/ (as for eval/gpu_session.sh): transformers' GDN prefill and plain decoding run on it
if [ "${FLA:-1}" = 1 ] && ls .whl/fla_core-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site-fla .whl/fla_core-*.whl
    export PYTHONPATH=/tmp/site-fla:$PYTHONPATH
fi
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader
python3 -c "import torch, transformers, accelerate, importlib.util as u; print('torch', torch.__version__, \
'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'fla', u.find_spec('fla') is not None, \
'GPUs', torch.cuda.device_count())"
step() {  # step NAME SECONDS COMMAND...: run with a limit, keep the log's tail on screen
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most ${limit} s)"
    local start=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "exit $?, $((SECONDS - start)) s" | tee -a "$OUT/$name.log"
    grep -E "passed|failed|skipped|FAILED|Error|warning|^\|" "$OUT/$name.log" | tail -30
}

step tests 110 env HF_BOLE_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider -rfs --tb=short \
    tests/generation/test_loop.py tests/models/test_placement.py tests/kernels/test_utils.py \
    -k "two_gpus or spread or placement or device"

step eval122 300 python3 eval/run.py --shape 122B-A10B --device-map auto --modes ar bole --batch-sizes 1 8 \
    --num-prompts 8 --prompt-length 128 --max-new-tokens 64 --depth 6 --repeats 1 --output-dir /tmp/eval122
cp /tmp/eval122/results.md "$OUT/eval122.md" 2>/dev/null
cp /tmp/eval122/results.jsonl "$OUT/eval122.jsonl" 2>/dev/null || cp /tmp/eval122/results.partial.jsonl "$OUT/eval122.jsonl"
