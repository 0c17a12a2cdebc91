#!/usr/bin/env bash
# The GPU work behind BENCHMARKS.md and the shipped budget tables, by part. On one GPU, from the repository root:
#
#     BOLE_COMMIT=$(git rev-parse --short HEAD) bash eval/gpu.sh PART...
#
# (BOLE_COMMIT names the commit of the working tree where the checkout's .git may lag behind it, as on a copy of the
# tree.) Every step has a time limit; a step cut short keeps what it finished (the harness's partial rows, the
# calibration's finished buckets). Parts, with what they write:
#
#   tests       the test suite on CUDA: tests/kernels, then tests/models, cache, generation and
#               test_custom_generate.py with HF_BOLE_TEST_DEVICE=cuda                                (logs only)
#   calibrate   the budget tables of the published 9B, 27B and 35B-A3B shapes on this GPU, bf16: more than one
#               10-minute command, so cal-9B, cal-27B, cal-35B-A3B one each (cal-house: the house checkpoint);
#               9B and house at batch 1 to 256 (about 3 minutes for the 9B), 27B and 35B-A3B to 64
#                                                                                  hf_bole/budgets/<key>.json
#   auto        bole_budget="auto" on a random-weight 9B shape in bf16 must read a table in hf_bole/budgets/ (the
#               log line), not calibrate or fall back                                                 (log only)
#   house1      end to end on the house model, MBPP, batch 1: ar, ar-static, chain, tree-serial, bole
#                                                                                benchmarks/e2e_house_b1.jsonl
#   house8      the same at batch 8                                              benchmarks/e2e_house_b8.jsonl
#   9b1         end to end on the random 9B shape, oracle drafter, batch 1: ar, ar-static, chain, tree-serial, bole
#                                                                                  benchmarks/e2e_9b_b1.jsonl
#   9b816       the same at batch 8 and 16, without ar-static (MODES_9B816)   benchmarks/e2e_9b_b8_b16.jsonl
#   kernels     one GDN layer's tree verify (serial walk, fla chain, closed form) and the commit
#                                                       benchmarks/kernels.jsonl (an H200's: kernels_h200.jsonl)
#   host        the host time of an eager tree_gdn_verify and of the ancestor build, GPU idle, the 9B layer's sizes
#               at (B, T) = (1, 16), (8, 64), (16, 64)                                 benchmarks/host.jsonl
#   kda         one KDA layer's tree verify (serial walk, fla chunk_kda chain, closed form) and the commit,
#               Kimi-Linear-48B-A3B's sizes                                              benchmarks/kda.jsonl
#   budget-house  "auto" against fixed budgets, house model, GSM8K, batch 8 and 1  benchmarks/budget_house.jsonl
#   budget-9b     the same on the 9B shape (its table first: cal-9B)                 benchmarks/budget_9b.jsonl
#   drafters    the house model, MBPP, batch 1: ar, hf_bole with the MTP head, n-gram and a small model (2 of the
#               house model's layers), transformers' assisted decoding with that small model and its prompt lookup
#               (these two need transformers >= 5.25)                          benchmarks/drafters_house_b1.jsonl
#   next1       end to end on the random Qwen3-Next-80B-A3B shape cut to 40 of its 48 layers (one H200; the whole
#               shape needs two GPUs), oracle drafter, batch 1: ar, ar-static, bole     benchmarks/e2e_next_b1.jsonl
#   cal-next    its budget table                                        hf_bole/budgets/<key>.json
#   families    greedy exactness of the supported families at their real shapes (random weights, bf16), 8 layers
#               each, oracle and n-gram drafters (eval/check_families.py): Qwen3.5, Qwen3-Next, OLMo-Hybrid and
#               Lara-Mini (about 7 min)                                                                   (logs only)
#   families-2  the same for Qwen4-Exp, Kimi-Linear and Bailing-Hybrid                                (logs only)
#   families-glm  the same for GLM-5-Next at 4 layers (8 take 74 GiB)                                  (logs only)
#   kimi1       end to end on the random Kimi-Linear-48B-A3B shape cut to 16 layers for one H100, batch 1: ar and
#               bole, oracle then n-gram drafter                  benchmarks/e2e_kimi_b1.jsonl, e2e_kimi_b1_ngram.jsonl
#   ling1       the same on Ling-3.0-flash cut to 12 layers (transformers >= 5.25; about 3.5 min)
#                                                                 benchmarks/e2e_ling_b1.jsonl, e2e_ling_b1_ngram.jsonl
#   batch-sweep   the random 9B shape at batch 1, 4, 16, 32 and 64, one batch each, oracle drafter: ar-static,
#                 chain, bole ("auto": cal-9B first, on this GPU)                    benchmarks/batch_sweep.jsonl
#   batch-sweep-big  the same at batch 128 and 256 (the seven batch sizes take more than one 10-minute command)
#                                                                                benchmarks/batch_sweep_big.jsonl
#   ttft        a conversation's second turn on the random 9B shape (2,000 tokens of history): the first new token
#               from the first turn's cache against re-prefilling, hf_bole and plain generate (and a profile of the
#               continued call, logs/ttft_trace.json)                                   benchmarks/ttft_turn2.jsonl
#   batch-sweep-mtp  the same with a random MTP head (what drafting costs): chain, bole, and bole at budget 0
#                 (plain decoding through hf_bole's loop)                        benchmarks/batch_sweep_mtp.jsonl
#   batch-sweep-mtp-big  its batch 128 and 256                               benchmarks/batch_sweep_mtp_big.jsonl
# On 2 or more GPUs of one host (tensor parallelism over all visible GPUs, NGPU; the 122B-A10B shape's 227 GiB of bf16
# weights need H200 x2 or H100 x4), each part one command of at most 10 minutes:
#   tp-tests    the tensor-parallel tests on two GPUs over NCCL (tests/test_tensor_parallel.py)
#               (logs only; about 2 min)
#   tp122-1     122B-A10B shape, random weights, bf16, oracle drafter, batch 1 (one prompt), sharded over NGPU
#               processes: ar (plain generate under the same TP) and bole, passes in turns (about 6 min, 9.5 at most)
#                                                                                  benchmarks/e2e_122b_tp_b1.jsonl
#   tp122-8     the same at batch 8 (8 prompts, one batch)                         benchmarks/e2e_122b_tp_b8.jsonl
#   dm122-1     the same shape and settings under --device-map auto (one process), batch 1 (about 5 min)
#                                                                                  benchmarks/e2e_122b_dm_b1.jsonl
#   dm122-8     the same at batch 8                                                benchmarks/e2e_122b_dm_b8.jsonl
#   tp27        27B shape, batch 1: ar and bole under TP over 2 GPUs, then both on one GPU (CUDA graphs on; about
#               8 min)                                  benchmarks/e2e_27b_tp2_b1.jsonl, benchmarks/e2e_27b_1gpu_b1.jsonl
#
# After the parts: eval/render_benchmarks.py rewrites BENCHMARKS.md, README.md's results and benchmarks/speedup.png,
# and everything the parts wrote, logs included, is packed into $OUT/gpu_results.tgz (OUT default runs/gpu); `tar
# -xzf gpu_results.tgz` in the clone puts it in place (the logs under runs/gpu/logs/), and `python
# eval/render_benchmarks.py` there states each table's currency by the clone's own history. A fla-core wheel in .whl/ is
# installed first (the `fla chain` column, and transformers' fast GDN path for `ar`); without it those run without.
# TF_WHEELS=<folder>: wheels installed ahead of the GPU's own packages, for parts that need a newer transformers than it
# has (drafters' transformers arms need 5.25; families' Lara-Mini, Bailing-Hybrid and GLM-5-Next are not in 5.17, and
# check_families skips them there): transformers and what it needs beyond the image, e.g. `pip download
# transformers==5.25.0 -d tf --python-version 3.12 --only-binary :all: --platform manylinux_2_17_x86_64 --platform
# manylinux_2_28_x86_64 --platform any` less what the image has (numpy, pyyaml, tqdm, packaging and torch's own
# dependencies: filelock, fsspec, typing-extensions).
set -uo pipefail
[ $# -gt 0 ] || { awk 'NR > 1 && !/^#/ { exit } NR > 1' "$0"; exit 2; }
OUT=${OUT:-runs/gpu}
LOGS=runs/gpu/logs
mkdir -p "$OUT" "$LOGS" benchmarks
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_BOLE_CACHE=${HF_BOLE_CACHE:-/tmp/hf_bole_cache}
export BOLE_COMMIT=${BOLE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}
if ls .whl/*.whl >/dev/null 2>&1; then  # wheels the device lacks: fla-core and what it needs (einops)
    python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site-whl .whl/*.whl
    export PYTHONPATH=/tmp/site-whl:$PYTHONPATH
fi
if [ -n "${TF_WHEELS:-}" ]; then
    python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site-tf "$TF_WHEELS"/*.whl
    export PYTHONPATH=/tmp/site-tf:$PYTHONPATH
fi
# installed, not only importable: transformers checks custom_generate/requirements.txt's hf-bole (tests)
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip install -e . failed"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers, importlib.util as u; print('torch', torch.__version__, 'triton', \
triton.__version__, 'transformers', transformers.__version__, 'fla', u.find_spec('fla') is not None)"
echo "commit $BOLE_COMMIT"
XDIST=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8" || echo "")
PYTEST="python3 -m pytest -q -p no:cacheprovider -rf --tb=short $XDIST"
FAILED=""
RENDER=0

step() {  # step NAME SECONDS COMMAND...: the command under a time limit, its log in $LOGS/NAME.log
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most $limit s)"
    local start=$SECONDS
    timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
    local rc=$?
    [ $rc = 0 ] || FAILED="$FAILED $name($rc)"
    echo "exit $rc, $((SECONDS - start)) s" | tee -a "$LOGS/$name.log"
    grep -E "passed|failed|FAILED|Error|wrote|reads the|found|^\| " "$LOGS/$name.log" | grep -v -e "|---" | tail -25
}
harness() {  # harness NAME SECONDS ARGS...: eval/run.py, its rows into benchmarks/NAME.jsonl (a cut-short run's too)
    local name=$1 limit=$2
    shift 2
    launched "$name" "$limit" python3 eval/run.py "$@"
}
harness_tp() {  # harness_tp NAME SECONDS NPROC ARGS...: the same with --tp under torchrun, over NPROC processes
    local name=$1 limit=$2 nproc=$3
    shift 3
    launched "$name" "$limit" python3 -m torch.distributed.run --standalone --nproc-per-node "$nproc" \
        eval/run.py --tp "$@"
}
launched() {  # launched NAME SECONDS COMMAND...: an eval/run.py command line, its output under /tmp/NAME
    local name=$1 limit=$2
    shift 2
    rm -rf "/tmp/$name"
    step "$name" "$limit" "$@" --output-dir "/tmp/$name"
    cp "/tmp/$name/results.jsonl" "benchmarks/$name.jsonl" 2>/dev/null \
        || cp "/tmp/$name/results.partial.jsonl" "benchmarks/$name.jsonl" 2>/dev/null
    cp "/tmp/$name/results.md" "$LOGS/$name.md" 2>/dev/null
    RENDER=1
}
kda_e2e() {  # kda_e2e SHAPE NAME: batch 1, ar and bole, the oracle drafter into NAME, the n-gram drafter into NAME_ngram
    for run in oracle: ngram:_ngram; do  # drafter:suffix of the run's name
        harness "$2${run#*:}" 280 --shape "$1" --drafter "${run%%:*}" --max-new-tokens 128 --depth 6 --repeats 3 \
            --interleave --batch-sizes 1 --num-prompts 2 --modes ar bole
    done
}
calibrate() {  # calibrate SHAPE SECONDS BATCH_SIZES...: a table at a KV length of 1024, into the package
    local source="--shape $1" name=$1 limit=$2
    shift 2
    [ "$name" = house ] && source="--model eval/house/checkpoint"
    step "cal-$name" "$limit" python3 -m hf_bole.calibrate $source --dtype bf16 --batch-sizes "$@" --kv-lengths 1024 \
        --reps 5 --table-dir hf_bole/budgets --plot "$LOGS/cal-$name.png"
    RENDER=1
}
BATCHES="1 4 8 16 32 64 128 256"
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
# The 122B-A10B runs: the device_map measurement before tensor parallelism used these settings (depth 6).
SHAPE122="--shape 122B-A10B --max-new-tokens 128 --depth 6 --repeats 3 --interleave --modes ar bole"
HOUSE="--datasets mbpp --num-prompts 8 --max-new-tokens 128 --depth 10 --chain-depth 10 --repeats 3 --interleave"
SHAPE9B="--shape 9B --max-new-tokens 128 --depth 6 --chain-depth 6 --repeats 3 --interleave"
# one batch per batch size, 64 new tokens: batch 256 then makes 16384 tokens a pass
SWEEP="--shape 9B --num-batches 1 --max-new-tokens 64 --depth 6 --chain-depth 6 --repeats 3 --interleave"
SMALL="--batch-sizes 1 4 16 32 64"
BIG="--batch-sizes 128 256"

for PART in "$@"; do
case $PART in
tests)
    step tests_kernels 200 $PYTEST tests/kernels
    step tests_models 370 env HF_BOLE_TEST_DEVICE=cuda $PYTEST tests/models tests/cache tests/generation \
        tests/test_custom_generate.py
    ;;
calibrate)
    calibrate 9B 420 $BATCHES
    calibrate 27B 300 1 4 8 16 32 64
    calibrate 35B-A3B 300 1 4 8 16 32 64
    ;;
cal-9B) calibrate 9B 420 $BATCHES ;;
cal-27B) calibrate 27B 300 1 4 8 16 32 64 ;;
cal-35B-A3B) calibrate 35B-A3B 300 1 4 8 16 32 64 ;;
cal-house) calibrate house 200 $BATCHES ;;
auto)
    step auto 150 python3 eval/check_auto_budget.py --shape 9B
    ;;
house1)
    harness e2e_house_b1 540 $HOUSE --batch-sizes 1 --modes ${MODES_HOUSE:-ar ar-static chain tree-serial bole}
    ;;
house8)
    harness e2e_house_b8 540 $HOUSE --batch-sizes 8 --modes ${MODES_HOUSE:-ar ar-static chain tree-serial bole}
    ;;
9b1)
    harness e2e_9b_b1 420 $SHAPE9B --batch-sizes 1 --num-prompts 2 --modes ${MODES_9B1:-ar ar-static chain tree-serial bole}
    ;;
9b816)
    harness e2e_9b_b8_b16 480 $SHAPE9B --batch-sizes 8 16 --num-prompts 16 --modes ${MODES_9B816:-ar chain tree-serial bole}
    ;;
kernels)
    # an H200's table beside an H100's
    NAME=kernels$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -q H200 && echo _h200)
    step kernels 240 python3 eval/bench_kernels.py --out "benchmarks/$NAME.jsonl" --providers serial fla bole \
        --shapes 32,1,16 32,1,128 48,1,128 32,8,64 32,16,64 32,16,128 48,8,64
    RENDER=1
    ;;
host)
    step host 120 python3 eval/bench_host.py --out benchmarks/host.jsonl
    RENDER=1
    ;;
kda)
    step kda 300 python3 eval/bench_kda.py --out benchmarks/kda.jsonl
    RENDER=1
    ;;
budget-house)
    harness budget_house 540 --datasets gsm8k --modes bole --batch-sizes 8 1 --num-prompts 8 --max-new-tokens 96 \
        --budget 32 128 248 auto --repeats 3 --interleave
    ;;
drafters)
    step drafters 540 python3 eval/bench_drafters.py --out benchmarks/drafters_house_b1.jsonl
    ;;
next1)
    harness e2e_next_b1 590 --shape Qwen3-Next-80B-A3B-40L --max-new-tokens 128 --depth 6 --chain-depth 6 --repeats 3 \
        --interleave --batch-sizes 1 --num-prompts 2 --modes ${MODES_NEXT1:-ar ar-static bole}
    ;;
cal-next) calibrate Qwen3-Next-80B-A3B-40L 400 ;;
families)
    step families 540 python3 eval/check_families.py --layers 8 --new 64 --families Qwen3.5 Qwen3-Next OLMo-Hybrid \
        Lara-Mini
    ;;
families-2)
    step families_2 540 python3 eval/check_families.py --layers 8 --new 64 --families Qwen4-Exp Kimi-Linear \
        Bailing-Hybrid
    ;;
families-glm)
    step families_glm 400 python3 eval/check_families.py --families GLM-5-Next --layers 4 --new 64
    ;;
kimi1) kda_e2e Kimi-Linear-48B-A3B-16L e2e_kimi_b1 ;;
ling1) kda_e2e Ling-3.0-flash-12L e2e_ling_b1 ;;
budget-9b)
    harness budget_9b 540 --shape 9B --depth 6 --modes bole --batch-sizes 8 1 --num-prompts 8 --max-new-tokens 96 \
        --budget 16 32 64 128 auto --repeats 3 --interleave
    ;;
batch-sweep)
    harness batch_sweep 540 $SWEEP $SMALL --modes ar-static chain bole
    ;;
batch-sweep-big)
    harness batch_sweep_big 540 $SWEEP $BIG --modes ar-static chain bole
    ;;
ttft)
    rm -f benchmarks/ttft_turn2.jsonl
    step ttft 240 python3 eval/ttft_turn2.py --shape 9B --out benchmarks/ttft_turn2.jsonl --profile "$LOGS/ttft_trace.json"
    RENDER=1
    ;;
batch-sweep-mtp)
    harness batch_sweep_mtp 540 $SWEEP $SMALL --drafter mtp --modes chain bole --budget auto 0
    ;;
batch-sweep-mtp-big)
    harness batch_sweep_mtp_big 540 $SWEEP $BIG --drafter mtp --modes chain bole --budget auto 0
    ;;
tp-tests)
    step tp_tests 300 $PYTEST tests/test_tensor_parallel.py
    ;;
tp122-1) harness_tp e2e_122b_tp_b1 570 "$NGPU" $SHAPE122 --batch-sizes 1 --num-prompts 1 ;;
tp122-8) harness_tp e2e_122b_tp_b8 570 "$NGPU" $SHAPE122 --batch-sizes 8 --num-prompts 8 ;;
dm122-1) harness e2e_122b_dm_b1 570 $SHAPE122 --device-map auto --batch-sizes 1 --num-prompts 1 ;;
dm122-8) harness e2e_122b_dm_b8 570 $SHAPE122 --device-map auto --batch-sizes 8 --num-prompts 8 ;;
tp27)
    harness_tp e2e_27b_tp2_b1 280 2 --shape 27B --max-new-tokens 128 --depth 6 --repeats 3 --interleave \
        --modes ar bole --batch-sizes 1 --num-prompts 1
    harness e2e_27b_1gpu_b1 280 --shape 27B --max-new-tokens 128 --depth 6 --repeats 3 --interleave \
        --modes ar bole --batch-sizes 1 --num-prompts 1
    ;;
*)
    echo "unknown part $PART"
    FAILED="$FAILED $PART(unknown)"
    ;;
esac
done

if [ $RENDER = 1 ]; then
    step render 120 python3 eval/render_benchmarks.py
fi
tar -czf "$OUT/gpu_results.tgz" README.md BENCHMARKS.md benchmarks hf_bole/budgets "$LOGS"
echo "packed $OUT/gpu_results.tgz; failed steps:${FAILED:- none}"
