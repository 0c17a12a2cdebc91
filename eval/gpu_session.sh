#!/usr/bin/env bash
# The GPU work left open, as parts that each fit one device command (10 minutes): `bash eval/gpu_session.sh PART`.
# Every step has its own time limit and writes under $OUT (default results/gpu_session), so a step that overruns
# costs only itself; the harness keeps finished rows in results.partial.jsonl. At most 8 files come back from a
# device: each part writes few.
#
#   checks   the test suite on CUDA (kernel tests with fla-core importable when .whl/ carries its wheel)
#   house    the harness on the house model: four modes + ar-static, batch 1 and 8, MBPP and GSM8K, phases profiled
#   budget   the house model's calibration table, then a fixed-budget and epsilon sweep with CUDA graphs
#   shapes   the 9B shape with the oracle drafter, CUDA graphs: ar and bole at batch 1, 8 and 16, phases profiled
#   kernels  the full kernel benchmark grid (eval/bench_kernels.py)
#   profile  torch profiler over ar, chain and bole on the house model at batch 1 and 8 (eval/profile_round.py)
#   profile9b  the same over ar and bole (CUDA graphs) on the 9B shape at batch 1
#   graphs   the house harness, ar vs bole with and without hf_bole's CUDA graphs (--no-cuda-graphs), phases
#   fla      with fla-core importable: its GDN kernels against transformers' torch reference, then the model tests
#   verify   at once: the CUDA-graph tests and the model tests with fla; then the house harness with fla and CUDA
#            graphs, ar vs bole at batch 1 and 8
set -uo pipefail
PART=${1:?usage: bash eval/gpu_session.sh checks|house|budget|shapes|kernels|profile|profile9b|graphs|fla|verify}
OUT=${OUT:-results/gpu_session}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_BOLE_CACHE=${HF_BOLE_CACHE:-/tmp/hf_bole_cache}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
# fla-core (carried in .whl/) is what a user of Qwen3.5 has installed: transformers then runs the GDN layers of
# prefill and plain decoding with it. With it importable, 14 model tests failed on 2026-11-30: hf_bole's seam
# re-ordered the recurrence's arguments and fla-core 0.6 took beta as gk (fixed; checked on CPU under the Triton
# interpreter). The `fla` part checks the fix on the GPU; the other parts import fla-core only with FLA=1 until then.
if ls .whl/fla_core-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-fla .whl/fla_core-*.whl
    if [ "$PART" = fla ] || [ "$PART" = verify ] || [ "${FLA:-0}" = 1 ]; then export PYTHONPATH=/tmp/site-fla:$PYTHONPATH; fi
fi
python3 -c "import torch, triton, transformers, importlib.util as u; print('torch', torch.__version__, 'triton', \
triton.__version__, 'transformers', transformers.__version__, 'fla', u.find_spec('fla') is not None)"
step() {  # step NAME SECONDS COMMAND...: run with a limit, keep the log's tail on screen
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most ${limit} s)"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "exit $?"
    grep -E "passed|failed|FAILED|Error|^\|" "$OUT/$name.log" | tail -30
}
case $PART in
checks)
    step tests 300 bash eval/gpu_tests.sh
    ;;
house)
    step house 540 python3 eval/run.py --datasets mbpp gsm8k --modes ar ar-static chain tree-serial bole \
        --batch-sizes 1 8 --num-prompts 8 --max-new-tokens 128 --profile --output-dir "$OUT/house"
    ;;
budget)  # the house model's calibration table, then a fixed-budget and epsilon sweep over it with CUDA graphs
    step calibrate_house 150 python3 -m hf_bole.calibrate --model eval/house/checkpoint --dtype bf16 \
        --batch-sizes 1 4 8 16 --kv-lengths 1024 --out "$OUT/budget_house.json" --plot /tmp/budget_house.png
    step sweep 200 python3 eval/run.py --datasets gsm8k --modes bole --batch-sizes 1 4 8 16 --num-prompts 16 \
        --max-new-tokens 64 --budget 16 32 64 128 auto --epsilon 0.05 0.1 0.25 --output-dir /tmp/sweep
    cp /tmp/sweep/results.md "$OUT/sweep_results.md"
    cp /tmp/sweep/results.jsonl /tmp/sweep/results.partial.jsonl "$OUT/" 2>/dev/null
    ;;
shapes)  # the issue-8 settings: 256 new tokens, depth 6, oracle at ~4 tokens/round, CUDA graphs
    step shape_9b 330 python3 eval/run.py --shape 9B --modes ar bole --batch-sizes 1 8 --depth 6 \
        --num-prompts 8 --max-new-tokens 256 --profile --output-dir /tmp/shape_9b
    step shape_9b_b16 200 python3 eval/run.py --shape 9B --modes ar bole --batch-sizes 16 --depth 6 \
        --num-prompts 16 --max-new-tokens 256 --profile --output-dir /tmp/shape_9b_b16
    for d in shape_9b shape_9b_b16; do
        cp /tmp/$d/results.md "$OUT/$d.md"; cp /tmp/$d/results.jsonl "$OUT/$d.jsonl" 2>/dev/null
        cp /tmp/$d/results.partial.jsonl "$OUT/$d.partial.jsonl" 2>/dev/null
    done
    ;;
profile)
    for b in 1 8; do
        step profile_house_b$b 150 python3 eval/profile_round.py --modes ar chain bole --batch-sizes $b \
            --datasets gsm8k --max-new-tokens 128 --json "$OUT/profile_house_b$b.json"
    done
    ;;
profile9b)
    step profile_9b_b1 150 python3 eval/profile_round.py --shape 9B --modes ar bole --depth 6 --batch-sizes 1 \
        --num-prompts 2 --max-new-tokens 64 --json "$OUT/profile_9b_b1.json"
    ;;
graphs)
    for g in "" --no-cuda-graphs; do
        step "house${g//-/_}" 270 python3 eval/run.py --datasets mbpp gsm8k --modes ar bole --batch-sizes 1 8 \
            --num-prompts 8 --max-new-tokens 128 --profile $g --output-dir "/tmp/house${g//-/_}"
        cp "/tmp/house${g//-/_}"/results*.jsonl "/tmp/house${g//-/_}/results.md" "$OUT/" 2>/dev/null
        for f in "$OUT"/results*; do mv "$f" "${f%/*}/house${g//-/_}_${f##*/}"; done
    done
    ;;
fla)
    step fla_check 300 python3 eval/gpu_fla_check.py
    step tests_with_fla 250 env HF_BOLE_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider -rf --tb=short \
        tests/models tests/cache tests/generation
    ;;
verify)
    python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip install -e . failed"
    PYTEST="python3 -m pytest -q -p no:cacheprovider -rf --tb=short"
    step graph_tests 200 env HF_BOLE_TEST_DEVICE=cuda $PYTEST tests/generation/test_graphs.py \
        tests/generation/test_mtp.py &
    step tests_with_fla 240 env HF_BOLE_TEST_DEVICE=cuda $PYTEST tests/models tests/cache \
        tests/generation/test_loop.py &
    wait
    step house_graphs 300 python3 eval/run.py --datasets mbpp gsm8k --modes ar bole --batch-sizes 1 8 \
        --num-prompts 8 --max-new-tokens 128 --profile --output-dir /tmp/house_graphs
    cp /tmp/house_graphs/results.md "$OUT/house_graphs.md"
    cp /tmp/house_graphs/results*.jsonl "$OUT/" 2>/dev/null
    ;;
kernels)
    step kernels 540 bash eval/gpu_kernels.sh
    ;;
*)
    echo "unknown part $PART" >&2
    exit 2
    ;;
esac
