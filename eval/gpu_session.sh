#!/usr/bin/env bash
# The GPU work left open, as parts that each fit one device command (10 minutes): `bash eval/gpu_session.sh PART`.
# Every step has its own time limit and writes under $OUT (default results/gpu_session), so a step that overruns
# costs only itself; the harness keeps finished rows in results.partial.jsonl. At most 8 files come back from a
# device: each part writes few. Carry .whl/fla_core-*.whl: fla-core is what a user of Qwen3.5 has installed, and
# with it transformers runs prefill and plain decoding's GDN layers through fla's kernels (set FLA=0 to leave it out).
#
#   checks     the test suite on CUDA (kernel tests, then model, cache and generation tests with fla importable)
#   verify     at once: the CUDA-graph tests and the model tests with fla; then the house harness, ar vs bole, batch
#              1 and 8 (about 5 minutes)
#   house      the harness on the house model: ar, ar-static, chain, tree-serial, bole, batch 1 and 8, MBPP and GSM8K
#   speed9b    issue 8 at batch 1: the 9B shape, oracle at ~4 tokens/round, depth 6, 256 new tokens, ar, ar-static
#              (transformers' static cache with torch.compile) and bole
#   batch9b    the same at batch 8 and 16, and tree-serial against bole at batch 16 with 64-node trees
#   final      the CUDA tests fixed in the fifth session, batch 16 with tree-serial, the 9B budget table
#   large      the 27B and 35B-A3B shapes at batch 1: ar, ar-static, bole
#   compile9b  the 9B shape at batch 1: ar, ar-static, and bole with and without bole_compile, in one run
#   compile    the house model at batch 1: ar, and bole with and without bole_compile, in one run
#   budget     the house model's calibration table (graph replays), then a fixed-budget and epsilon sweep
#   budget9b   the same for the 9B shape (oracle drafter)
#   batch9bc   the 9B shape at batch 8 with and without bole_compile against ar-static; 35B-A3B at batch 1
#   verify6    the sixth session's CPU-only changes on a GPU: MoE graphs, compiled selection, dynamic compile
#   large27    the 27B shape at batch 1, ar and bole, one prompt (under 3 minutes)
#   speed7     issue 8 on the 9B shape with the one-graph dynamic compile: batch 1 against ar-static, then batch 8
#              and 16 (budgets 32 and 64, eager and compiled) against ar-static
#   check7     the CUDA tests of graphs and MoE experts; the 9B shape at batch 16 against ar-static; the house model
#              against chain and tree-serial at batch 1 and 8; 35B-A3B at batch 1 with graphs
#   compile816 the 9B shape at batch 8 and 16, budget 32: ar-static, bole eager and with bole_compile, in one run
#   compile16  the 9B shape at batch 16, budget 64: ar-static and bole with bole_compile
#   housec     the house model at batch 1: chain and bole, each with and without bole_compile (MTP drafter compiled)
#   batch16    the 9B shape at batch 16, budgets 32 and 64 (eager, graphs) against ar-static: what check7 could not
#              finish (its bole warm-up outlasted 170 s); then the house model's GSM8K against chain and tree-serial
#   sweep9b    budget9b's sweep only, on the committed 9B table (results/budget_h200_9b/budget_9b.json)
#   kernels    the full kernel benchmark grid (eval/bench_kernels.py)
#   profile    torch profiler over ar, chain and bole on the house model at batch 1 and 8 (eval/profile_round.py)
#   profile9b  the same over ar and bole on the 9B shape at batch 1
#   fla        fla-core's GDN kernels against transformers' torch reference, then the model tests with fla
#   devmap     on nvidia-h200-x2 (issue 6): the two-GPU CUDA tests (a tiny model split over cuda:0 and cuda:1 decodes
#              exactly as plain greedy, each layer's state on its own GPU), then the 122B-A10B shape (227 GiB in bf16)
#              built across both GPUs (eval/shapes.py build_model_across), ar against bole at batch 1 and 8
#   dp         on nvidia-h200-x2 (issue 6): the house harness (bole) in one process, then data-parallel over both GPUs
#              (accelerate launch): compare the rows' prompts/s (all processes together) with the one-process run's
#   dpthreads  on nvidia-h200-x2: dp's one process started plainly and through accelerate launch, same prompts
#   tune       the kernel, model and graph tests on CUDA; every launch config of the closed form's kernels at issue
#              2's two target shapes (eval/tune_kernels.py); Nsight Compute over the 8-warp configs
#   profile9bc the torch profiler over bole with bole_compile on the 9B shape at batch 1: where the compiled verify
#              forward's 7 ms go (issue 8's 600 tokens/s)
#   pdl        the kernel tests; the benchmark with the apply kernel launched during the solve kernel (programmatic
#              dependent launch) beside it launched after; Nsight Compute over both kernels at issue 2's two shapes
#   sweep11    issue 5 on the 9B shape: the table bench11 measured installed, budgets 16-128, auto and goodput
#   house12    issue 5 on the house model: its table (graph replays), then GSM8K at batch 16/8/4/1 over budgets 16-256,
#              auto and goodput (goodput reading the draft probabilities selection ranked)
#   house12b   house12's sweep again on its table (installed from results), 7 timed passes per batch: house12's 3
#              passes differed by up to 49%
#   turns      issue 5's house sweep with the timed passes in turns (--interleave), on its twelfth-session table
#              (house12b's sweep differed by 11% between identical trees timed minutes apart)
#   turns9b    the same on the 9B shape, on bench11's table
#   select     the select kernel's tests on CUDA, eval/bench_select.py (select_nodes replayed from a graph against the
#              one-launch Triton kernel), then the compiled 9B verify's kernels one by one (profile_round --kernel-log)
#   bench11    the benchmark at 16 shapes (kernels without elementwise norms); the 9B shape's budget table; the kernel
#              tests on CUDA
#   bench10    the benchmark at 16 shapes with the launch configs kernels10 chose
#   kernels10  the kernel tests, the narrowed config sweep at issue 2's two shapes, the benchmark at 16 shapes
#   split      the kernel tests; the closed form's kernels (closed_form_kernels.py) beside the serial walk and fla's
#              chain at issue 2's target shapes and the tree sizes a model verifies; the model and graph tests on CUDA
set -uo pipefail
PART=${1:?usage: bash eval/gpu_session.sh speed7|check7|compile816|compile16|housec|batch16|checks|verify|house|speed9b|batch9b|final|large|compile9b|compile|budget|budget9b|sweep9b|batch9bc|large27|verify6|kernels|profile|profile9b|fla|devmap|dp|dpthreads|split|profile9bc|tune|pdl|kernels10|bench10|bench11|sweep11|house12|house12b|turns|turns9b|select}
OUT=${OUT:-results/gpu_session}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_BOLE_CACHE=${HF_BOLE_CACHE:-/tmp/hf_bole_cache}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [ "${FLA:-1}" = 1 ] && ls .whl/fla_core-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site-fla .whl/fla_core-*.whl
    export PYTHONPATH=/tmp/site-fla:$PYTHONPATH
fi
# installed (not only on PYTHONPATH) so that transformers finds custom_generate/requirements.txt's hf-bole
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip install -e . failed"
python3 -c "import torch, triton, transformers, importlib.util as u; print('torch', torch.__version__, 'triton', \
triton.__version__, 'transformers', transformers.__version__, 'fla', u.find_spec('fla') is not None)"
FAILED_STEPS=""  # steps that exited non-zero (not those run in the background with &: a subshell's)
step() {  # step NAME SECONDS COMMAND...: run with a limit, keep the log's tail on screen
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most ${limit} s)"
    local start=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    [ $rc = 0 ] || FAILED_STEPS="$FAILED_STEPS $name($rc)"
    echo "exit $rc, $((SECONDS - start)) s" | tee -a "$OUT/$name.log"
    grep -E "passed|failed|FAILED|Error|^\|" "$OUT/$name.log" | tail -30
}
harness() {  # harness NAME SECONDS ARGS...: eval/run.py into /tmp/NAME, its table and rows copied to $OUT
    local name=$1 limit=$2
    shift 2
    step "$name" "$limit" python3 eval/run.py --output-dir "/tmp/$name" "$@"
    cp "/tmp/$name/results.md" "$OUT/$name.md" 2>/dev/null
    cp "/tmp/$name/results.jsonl" "$OUT/$name.jsonl" 2>/dev/null || cp "/tmp/$name/results.partial.jsonl" "$OUT/$name.jsonl"
}
ncu_step() {  # ncu_step NAME SECONDS ARGS...: eval/ncu_kernels.py ARGS under Nsight Compute (registers, stalls)
    local name=$1 limit=$2
    shift 2
    local ncu
    ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    step "$name" "$limit" "$ncu" --clock-control none -k regex:tree_gdn_verify --section LaunchStats \
        --section Occupancy --section SpeedOfLight --section WarpStateStats python3 eval/ncu_kernels.py "$@"
}
# The committed tables were measured with the model's own attention (their key's launch is "graphs"): the parts that
# install one run bole_attention="model", which reads them ("auto" on a GPU reads "triton-attention-graphs" tables).
install_table() {  # install_table PATH: a committed budget table where generate's "auto" looks (not measured again)
    python3 -c "from hf_bole.generation.budget import BudgetTable; t = BudgetTable.load('$1'); \
print('installed', t.save(t.default_path()))"
}
# Issue 2's two target shapes first, then the tree sizes a model verifies
SHAPES16="32,16,128 48,1,128 32,1,128 48,8,128 48,16,128 64,16,128 32,1,16 32,1,32 48,1,32 32,1,64 32,8,16 32,8,32
    32,8,64 32,16,16 32,16,64 64,16,64"
# 8 workers, as eval/gpu_tests.sh runs them: one process spent check7's 100 s compiling Triton kernels test by test
XDIST=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8" || echo "")
PYTEST="python3 -m pytest -q -p no:cacheprovider -rf --tb=short $XDIST"
SHAPE9B="--shape 9B --depth 6 --max-new-tokens 256 --profile"
case $PART in
checks)
    step tests 300 bash eval/gpu_tests.sh
    ;;
verify)
    step graph_tests 200 env HF_BOLE_TEST_DEVICE=cuda $PYTEST tests/generation/test_graphs.py \
        tests/generation/test_mtp.py tests/generation/test_budget.py &
    step tests_with_fla 240 env HF_BOLE_TEST_DEVICE=cuda $PYTEST tests/models tests/cache \
        tests/generation/test_loop.py &
    wait
    harness house_graphs 300 --datasets mbpp gsm8k --modes ar bole --batch-sizes 1 8 --num-prompts 8 \
        --max-new-tokens 128 --profile
    ;;
house)
    harness house 540 --datasets mbpp gsm8k --modes ar ar-static chain tree-serial bole --batch-sizes 1 8 \
        --num-prompts 8 --max-new-tokens 128 --profile
    ;;
speed9b)  # ar at batch 1 takes ~40 ms a step: 4 prompts, each timed 3 times
    harness speed9b_b1 560 $SHAPE9B --modes ar ar-static bole --batch-sizes 1 --num-prompts 4
    ;;
batch9b)
    harness speed9b_b8 250 $SHAPE9B --modes ar ar-static bole --batch-sizes 8 --num-prompts 8
    harness serial9b_b16 300 $SHAPE9B --modes ar tree-serial bole --batch-sizes 16 --num-prompts 16 --budget 1024
    ;;
final)  # this session's last call: the CUDA tests fixed after the first call, batch 16 with tree-serial, the 9B table
    step fixed_tests 90 env HF_BOLE_TEST_DEVICE=cuda $PYTEST tests/generation/test_budget.py \
        tests/generation/test_graphs.py -k "auto or replayed_selection"
    harness serial9b_b16 240 $SHAPE9B --modes ar ar-static tree-serial bole --batch-sizes 16 --num-prompts 16 \
        --budget 1024 --repeats 1
    step calibrate_9b 170 python3 -m hf_bole.calibrate --shape 9B --dtype bf16 --batch-sizes 1 4 8 16 \
        --kv-lengths 512 --reps 5 --out "$OUT/budget_9b.json" --plot "$OUT/budget_9b.png"
    ;;
large)  # issue 8's larger shapes at batch 1; 35B-A3B is mixture-of-experts (grouped_mm experts: captured)
    for shape in 27B 35B-A3B; do
        # the harness runs its modes as ar, ar-static, ..., bole: ar-static in a run of its own, after bole, because
        # its compile may fail on a mixture of experts
        harness "shape_${shape}_b1" 200 --shape $shape --depth 6 --max-new-tokens 128 --profile \
            --modes ar bole --batch-sizes 1 --num-prompts 2 --repeats 1
        harness "shape_${shape}_b1_static" 90 --shape $shape --depth 6 --max-new-tokens 128 --modes ar-static \
            --batch-sizes 1 --num-prompts 2 --repeats 1
    done
    ;;
compile9b)  # the 9B shape at batch 1: ar, ar-static, bole eager and compiled side by side in one run
    # one graph for 32 layers, compiled again once tree widths vary (dynamic shapes): give it room
    harness speed9b_b1_compile 560 $SHAPE9B --modes ar ar-static bole --batch-sizes 1 --num-prompts 2 --compile off on
    ;;
compile)
    harness house_b1_compile 300 --datasets gsm8k --modes ar bole --batch-sizes 1 --num-prompts 8 \
        --max-new-tokens 128 --profile --compile off on
    ;;
budget)
    step calibrate_house 150 python3 -m hf_bole.calibrate --model eval/house/checkpoint --dtype bf16 \
        --batch-sizes 1 4 8 16 --kv-lengths 1024 --out "$OUT/budget_house.json" --plot "$OUT/budget_house.png"
    harness sweep_house 420 --datasets gsm8k --modes bole --batch-sizes 1 4 8 16 --num-prompts 16 \
        --max-new-tokens 128 --budget 16 32 64 128 auto --profile
    ;;
budget9b)
    step calibrate_9b 200 python3 -m hf_bole.calibrate --shape 9B --dtype bf16 --batch-sizes 1 4 8 16 \
        --kv-lengths 512 --reps 5 --out "$OUT/budget_9b.json" --plot "$OUT/budget_9b.png"
    harness sweep_9b 380 --shape 9B --depth 6 --modes bole --batch-sizes 1 4 8 16 --num-prompts 16 \
        --max-new-tokens 128 --budget 16 32 64 128 auto --profile
    ;;
sweep9b)  # budget9b's sweep on the table the fifth session measured (results/budget_h200_9b), not measured again:
    # 128 new tokens (with 64, prefill was a quarter of a batch-1 call), the default epsilon (0.25)
    install_table results/budget_h200_9b/budget_9b.json
    harness sweep_9b 560 --shape 9B --depth 6 --modes bole --batch-sizes 1 4 8 16 --num-prompts 16 \
        --max-new-tokens 128 --budget 16 32 64 128 auto --profile --attention model
    ;;
batch9bc)  # sixth session's last call: the 9B shape at batch 8, bole eager and compiled against ar-static (budget
    # 32: sweep9b's best at batch 8), then the 35B-A3B shape at batch 1 (no CUDA graphs: mixture of experts)
    harness speed9b_b8_compile 320 $SHAPE9B --modes ar ar-static bole --batch-sizes 8 --num-prompts 8 --budget 32 \
        --compile off on
    harness shape_35B-A3B_b1 230 --shape 35B-A3B --depth 6 --max-new-tokens 128 --profile --modes ar bole \
        --batch-sizes 1 --num-prompts 2 --repeats 1
    ;;
large27)  # the 27B shape at batch 1, ar and bole only, one prompt: what fits in the last 3 minutes of a session
    harness shape_27B_b1 140 --shape 27B --depth 6 --max-new-tokens 128 --profile --modes ar bole --batch-sizes 1 \
        --num-prompts 1 --repeats 1
    ;;
verify6)  # what the sixth session built without a GPU: mixture-of-experts graphs (grouped_mm), compiled selection,
    # the dynamic compile of the verify forward (its speed against e068a7c's 7.11 ms verify at 9B batch 1)
    # the compile takes minutes (the sixth session's first at batch 8 was not done after ~110 s): it goes first
    harness speed9b_b1_dynamic 300 $SHAPE9B --modes ar-static bole --batch-sizes 1 --num-prompts 2 --compile on
    step tests6 120 env HF_BOLE_TEST_DEVICE=cuda $PYTEST tests/generation/test_graphs.py tests/generation/test_mtp.py \
        tests/generation/test_select.py -k "graphs or compiled or experts or host"
    harness shape_35B-A3B_b1_graphs 160 --shape 35B-A3B --depth 6 --max-new-tokens 128 --profile --modes ar bole \
        --batch-sizes 1 --num-prompts 2 --repeats 1
    ;;
speed7)  # seventh session, first call: the compile takes minutes, each run has its own limit
    harness speed9b_b1_dynamic 290 $SHAPE9B --modes ar-static bole --batch-sizes 1 --num-prompts 2 --compile on
    harness speed9b_b8_b16 280 $SHAPE9B --modes ar-static bole --batch-sizes 8 16 --num-prompts 16 --budget 32 64 \
        --compile off on
    ;;
check7)  # seventh session, second call, by importance: the CUDA tests of graphs and MoE experts, the 9B shape at
    # batch 16 (eager, graphs) against ar-static, the house model against chain and tree-serial, 35B-A3B with graphs
    step tests7 100 env HF_BOLE_TEST_DEVICE=cuda $PYTEST tests/generation/test_graphs.py tests/generation/test_mtp.py \
        -k "graphs or experts or host"
    harness speed9b_b16 170 $SHAPE9B --modes ar-static bole --batch-sizes 16 --num-prompts 16 --budget 32 64
    harness house7 200 --datasets mbpp gsm8k --modes ar chain tree-serial bole --batch-sizes 1 8 --num-prompts 8 \
        --max-new-tokens 128 --profile --repeats 1
    harness shape_35B-A3B_b1_graphs 100 --shape 35B-A3B --depth 6 --max-new-tokens 128 --profile --modes ar bole \
        --batch-sizes 1 --num-prompts 1 --repeats 1
    ;;
compile816)  # eighth session: bole_compile (static first, then symbolic) at batch 8 and 16 against ar-static, budget 32
    harness speed9b_b8_b16_compile 570 $SHAPE9B --modes ar-static bole --batch-sizes 8 16 --num-prompts 16 --budget 32 \
        --compile off on
    ;;
compile16)  # eighth session: what compile816 could not reach: batch 16, bole_compile, budget 64 (sweep9b's best there)
    harness speed9b_b16_compile 540 $SHAPE9B --modes ar-static bole --batch-sizes 16 --num-prompts 16 --budget 64 \
        --compile on
    ;;
housec)  # eighth session: bole_compile now compiles the MTP drafter's rounds too (house: drafting is the largest
    # phase); its CUDA test, then ar, chain and bole with and without it at batch 1, against issue 8's bole >= 1.2x
    # chain. In the eighth session 190 s reached only the compiled chain's compile: give it the rest of the call
    # ninth session: 100 s passed 2 of the drafter's CUDA tests, the compiled one still compiling; the harness took 289 s
    step drafter_tests 200 env HF_BOLE_TEST_DEVICE=cuda $PYTEST tests/generation/test_mtp.py -k "cuda_graphs_match"
    harness house_compile 360 --datasets mbpp --modes ar chain bole --batch-sizes 1 --num-prompts 8 \
        --max-new-tokens 128 --profile --repeats 1 --compile off on
    ;;
batch16)
    harness speed9b_b16 400 $SHAPE9B --modes ar-static bole --batch-sizes 16 --num-prompts 16 --budget 32 64
    harness house_gsm8k 180 --datasets gsm8k --modes ar chain tree-serial bole --batch-sizes 1 8 --num-prompts 8 \
        --max-new-tokens 128 --profile --repeats 1
    ;;
kernels)
    step kernels 540 bash eval/gpu_kernels.sh
    ;;
split)  # ninth session: 150 + 330 + 120 s
    step kernel_tests 150 $PYTEST tests/kernels/test_closed_form.py
    step bench_split 330 python3 eval/bench_kernels.py --out "$OUT/kernels_split.jsonl" --providers serial fla bole \
        solve --shapes $SHAPES16
    tail -21 "$OUT/bench_split.log"
    step model_tests 120 env HF_BOLE_TEST_DEVICE=cuda $PYTEST tests/models tests/generation/test_graphs.py
    ;;
pdl)  # tenth session: 100 + 300 + 90 s
    step kernel_tests 100 $PYTEST tests/kernels/test_closed_form.py
    step bench_pdl 300 python3 eval/bench_kernels.py --out "$OUT/kernels_pdl.jsonl" --shapes $SHAPES16
    tail -21 "$OUT/bench_pdl.log"
    ncu_step ncu 90 --shapes 32,16,128 48,1,128
    grep -E "tree_gdn|Registers|Spill|Achieved Occ|Theoretical Occ|Duration|Compute \(SM\) Thr|Memory Thr|Block Limit" \
        "$OUT/ncu.log" | head -80
    ;;
tune)  # tenth session: 100 + 130 + 280 + 40 s; 24 configs compile per tree tile and batch of 1 or more
    step kernel_tests 100 $PYTEST tests/kernels/test_closed_form.py
    step model_tests 130 env HF_BOLE_TEST_DEVICE=cuda $PYTEST tests/models tests/generation/test_graphs.py
    step tune 280 python3 eval/tune_kernels.py --shapes 32,16,128 48,1,128 --out "$OUT/tune.jsonl"
    tail -30 "$OUT/tune.log"
    ncu_step ncu8 40 --shapes 32,16,128 48,1,128 --calls 1 --solve-config 64,8,1 --apply-config 64,32,8,1
    grep -E "^  tree_gdn|Registers Per|Achieved Occ|Duration|Est. Local|stalled" "$OUT/ncu8.log" | head -60
    ;;
kernels10)  # tenth session: 100 + 150 + 270 s
    step kernel_tests 100 $PYTEST tests/kernels/test_closed_form.py
    step tune 150 python3 eval/tune_kernels.py --shapes 32,16,128 48,1,128 --out "$OUT/tune.jsonl"
    tail -22 "$OUT/tune.log"
    step bench 270 python3 eval/bench_kernels.py --out "$OUT/kernels.jsonl" --shapes $SHAPES16
    tail -21 "$OUT/bench.log"
    ;;
sweep11)  # eleventh session, second call: bench11's 9B table installed (not measured again), 96 new tokens
    install_table results/kernels_h200_eleventh/bench11/budget_9b.json
    harness sweep_9b 570 --shape 9B --depth 6 --modes bole --batch-sizes 16 8 4 1 --num-prompts 16 \
        --max-new-tokens 96 --budget 16 32 64 128 auto goodput --profile --attention model
    ;;
house12)  # twelfth session: 150 + 420 s
    step calibrate_house 150 python3 -m hf_bole.calibrate --model eval/house/checkpoint --dtype bf16 \
        --batch-sizes 1 4 8 16 --kv-lengths 1024 --out "$OUT/budget_house.json" --plot "$OUT/budget_house.png"
    harness sweep_house 420 --datasets gsm8k --modes bole --batch-sizes 16 8 4 1 --num-prompts 16 \
        --max-new-tokens 96 --budget 16 32 64 128 256 auto goodput --profile
    ;;
house12b)  # twelfth session, second call: house12's table installed (not measured again)
    install_table results/budget_h200_house/twelfth/budget_house.json
    harness sweep_house_r7 500 --datasets gsm8k --modes bole --batch-sizes 16 8 4 1 --num-prompts 16 \
        --max-new-tokens 96 --budget 16 32 64 256 auto goodput --repeats 7 --profile --attention model
    ;;
turns)  # house12b took 453 s with 7 timed passes
    install_table results/budget_h200_house/twelfth/budget_house.json
    harness turns_house 540 --datasets gsm8k --modes bole --batch-sizes 16 8 4 1 --num-prompts 16 \
        --max-new-tokens 96 --budget 16 32 64 256 auto goodput --repeats 5 --interleave --profile \
        --attention model
    ;;
turns9b)  # sweep11 took 538 s with 16 prompts and 3 timed passes
    install_table results/kernels_h200_eleventh/bench11/budget_9b.json
    harness turns_9b 540 --shape 9B --depth 6 --modes bole --batch-sizes 16 8 4 1 --num-prompts 8 \
        --max-new-tokens 96 --budget 16 32 64 128 auto goodput --repeats 3 --interleave --profile \
        --attention model
    ;;
select)  # first compiles: give the tests room
    step select_tests 200 $PYTEST tests/generation/test_select_kernel.py tests/generation/test_select.py
    step bench_select 150 python3 eval/bench_select.py --out "$OUT/select.jsonl"
    step profile_9b_b1_compiled 220 python3 eval/profile_round.py --shape 9B --modes bole --compile on --depth 6 \
        --batch-sizes 1 --num-prompts 1 --max-new-tokens 64 --top 30 --json "$OUT/profile_9b_b1_compiled.json" \
        --kernel-log "$OUT"
    tail -8 "$OUT/profile_9b_b1_compiled.log"
    tail -22 "$OUT/bench_select.log"
    ;;
bench11)  # eleventh session, first call: 300 + 190 + 80 s
    step bench 300 python3 eval/bench_kernels.py --out "$OUT/kernels.jsonl" --shapes $SHAPES16 --providers serial fla \
        bole solve
    tail -21 "$OUT/bench.log"
    step calibrate_9b 190 python3 -m hf_bole.calibrate --shape 9B --dtype bf16 --batch-sizes 1 4 8 16 \
        --kv-lengths 512 --reps 5 --out "$OUT/budget_9b.json" --plot "$OUT/budget_9b.png"
    step kernel_tests 80 $PYTEST tests/kernels/test_closed_form.py
    ;;
bench10)  # tenth session: 300 s (a first try with 150 s on a fresh machine was cut short)
    step bench 300 python3 eval/bench_kernels.py --out "$OUT/kernels.jsonl" --shapes $SHAPES16
    tail -21 "$OUT/bench.log"
    ;;
profile9bc)
    step profile_9b_b1_compiled 420 python3 eval/profile_round.py --shape 9B --modes bole --compile on --depth 6 \
        --batch-sizes 1 --num-prompts 1 --max-new-tokens 64 --top 30 --json "$OUT/profile_9b_b1_compiled.json"
    tail -90 "$OUT/profile_9b_b1_compiled.log"
    ;;
fla)
    step fla_check 300 python3 eval/gpu_fla_check.py
    step tests_with_fla 250 env HF_BOLE_TEST_DEVICE=cuda $PYTEST tests/models tests/cache tests/generation
    ;;
devmap)  # seventh session: 110 + 300 s (results/devmap_h200x2)
    step devmap_tests 110 env HF_BOLE_TEST_DEVICE=cuda $PYTEST -rfs tests/generation/test_loop.py \
        tests/models/test_placement.py tests/kernels/test_utils.py -k "two_gpus or spread or placement or device"
    harness eval122 300 --shape 122B-A10B --device-map auto --modes ar bole --batch-sizes 1 8 --num-prompts 8 \
        --prompt-length 128 --max-new-tokens 64 --depth 6 --repeats 1
    ;;
dp)  # bole only (ar, host-bound at ~11 ms a token, would take most of the step), 32 prompts a dataset (all the
    # bundled MBPP ones) so that one process's share is not decided by a few long completions; one process and two,
    # both through accelerate launch (which sets OMP_NUM_THREADS=1 in its processes); ~2 minutes in all
    DP="--datasets mbpp gsm8k --modes bole --batch-sizes 1 --num-prompts 32 --max-new-tokens 128 --repeats 1"
    for n in 1 2; do
        step dp_$n 70 accelerate launch --num_processes $n eval/run.py $DP --output-dir /tmp/dp_$n
        cp /tmp/dp_$n/results.md "$OUT/dp_$n.md" 2>/dev/null
        cp /tmp/dp_$n/results.jsonl "$OUT/dp_$n.jsonl" 2>/dev/null
    done
    python3 - "$OUT" <<'PY'
import json, sys
one, two = ([json.loads(l) for l in open(f"{sys.argv[1]}/dp_{n}.jsonl")] for n in (1, 2))
print("| dataset | mode | prompts/s, 1 process | 2 processes | ratio | same outputs |")
for a, b in zip(one, two):
    print(f"| {a['dataset']} | {a['mode']} | {a['prompts_per_s']:.3f} | {b['prompts_per_s']:.3f} | "
          f"{b['prompts_per_s'] / a['prompts_per_s']:.2f}x | {a['outputs_sha256'] == b['outputs_sha256']} |")
PY
    ;;
dpthreads)  # on nvidia-h200-x2: dp's one process started plainly (torch's default threads) and through accelerate
    # (OMP_NUM_THREADS=1) on the same prompts and machine: whether the launcher's threads explain the 13-16% gap
    # between the eighth session's two one-process runs (results/dp_h200x2)
    DP="--datasets mbpp gsm8k --modes bole --batch-sizes 1 --num-prompts 32 --max-new-tokens 128 --repeats 1"
    harness dp_python 70 $DP
    step dp_1 70 accelerate launch --num_processes 1 eval/run.py $DP --output-dir /tmp/dp_1
    cp /tmp/dp_1/results.jsonl "$OUT/dp_1.jsonl" 2>/dev/null
    python3 - "$OUT" <<'PY'
import json, sys
plain, launched = ([json.loads(l) for l in open(f"{sys.argv[1]}/{n}.jsonl")] for n in ("dp_python", "dp_1"))
print("| dataset | tokens/s, python | tokens/s, accelerate launch | cpu threads | same outputs |")
for a, b in zip(plain, launched):
    print(f"| {a['dataset']} | {a['output_tokens_per_s']:.1f} | {b['output_tokens_per_s']:.1f} | "
          f"{plain[0]['machine']['cpu_threads']} vs {launched[0]['machine']['cpu_threads']} | "
          f"{a['outputs_sha256'] == b['outputs_sha256']} |")
PY
    ;;
*)
    echo "unknown part $PART" >&2
    exit 2
    ;;
esac
# the part's exit status says whether every step passed (each step's own status is in its log and above)
if [ -n "$FAILED_STEPS" ]; then
    echo "failed steps:$FAILED_STEPS"
    exit 1
fi
