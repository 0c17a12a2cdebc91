#!/usr/bin/env bash
# The thirty-third session's GPU runs (README.md beside this file says what each measured).
# Usage, from the repository root, with fla-core's wheel in .whl/:
#   OUT=... bash results/speed_h200/thirty_third_session/gpu.sh PART...   (parts in turn, on one machine)
# Budget tables: format 4 (replayed forwards timed at `row_width`'s bucket). `calibrate` measures them and copies them
# (named by their keys) to $OUT/tables; a later call installs the copies kept in tables/ beside this file.
set -uo pipefail
. eval/gpu_preamble.sh
HERE=results/speed_h200/thirty_third_session
mkdir -p "$HF_BOLE_CACHE/budgets"
ls "$HERE"/tables/*.json >/dev/null 2>&1 && cp "$HERE"/tables/*.json "$HF_BOLE_CACHE/budgets/"
NODES="0 8 16 32 64 96 128 192 256 384 512"
for PART in "$@"; do
case $PART in
tests)  # on CUDA: the compiled tree forward against the eager one (the last session's fix), the loop's graphs,
        # pipelining without waits, the row cap, calibration replaying graphs
    HF_BOLE_TEST_DEVICE=cuda step model_tests "${MODEL_TESTS_S:-150}" python3 -m pytest -q -p no:cacheprovider -rf \
        --tb=short tests/models/test_qwen3_5.py -k compile
    HF_BOLE_TEST_DEVICE=cuda step loop_tests "${LOOP_TESTS_S:-200}" python3 -m pytest -q -p no:cacheprovider -rf \
        --tb=short tests/generation/test_graphs.py tests/generation/test_loop.py tests/generation/test_budget.py \
        -k "graph or pipelined or capped or replays or width"
    ;;
abwidth8)  # rows capped at their budget's width against the old cut, house model, batch 8, the format-3 tables'
           # budgets (bole 192, tree-serial 64), ten passes in turns
    STEP_SHOWS="median|Error|error" STEP_TAIL=8 step abwidth8 "${ABW_S:-300}" python3 "$HERE/ab_width.py" \
        --datasets mbpp --num-prompts 8 --max-new-tokens 128 --batch-sizes 8 --depth 6 --repeats 10 \
        --bole-budget 192 --serial-budget 64 --output-dir "$OUT"
    ;;
ab9b8)  # the same on the random 9B shape, oracle drafter, batch 8, 32 nodes for both, three passes in turns
    STEP_SHOWS="median|Error|error" STEP_TAIL=8 step ab9b8 "${AB9_S:-300}" python3 "$HERE/ab_width.py" \
        --shape 9B --num-prompts 8 --max-new-tokens 256 --batch-sizes 8 --depth 6 --repeats 3 \
        --bole-budget 32 --serial-budget 32 --output-dir "$OUT"
    ;;
calibrate)  # the house tables, closed form (batches 1, 4, 8, 16) and serial verify (1, 8), KV 1024, 5 repetitions
    for verify in closed_form serial; do
        batches="1 4 8 16"
        [ $verify = serial ] && batches="1 8"
        STEP_SHOWS="^ +[0-9]|wrote|Error" STEP_TAIL=12 step "cal_$verify" "${CAL_S:-300}" python3 -m hf_bole.calibrate \
            --model eval/house/checkpoint --dtype bf16 --batch-sizes $batches --kv-lengths 1024 --nodes $NODES \
            --reps 5 --verify $verify --plot "/tmp/cal_$verify.png"
    done
    mkdir -p "$OUT/tables" && cp "$HF_BOLE_CACHE"/budgets/*.json "$OUT/tables/"
    ;;
floor1)  # every mode at the tables' budgets ("auto"), batch 1, depth 6, five passes in turns (needs ~220 s)
    house_run floor1 "${FLOOR_S:-240}" mbpp --modes ar chain tree-serial bole --batch-sizes 1 --repeats 5 --depth 6
    ;;
floor8)  # the same at batch 8, ten passes
    house_run floor8 "${FLOOR_S:-240}" mbpp --modes ar chain tree-serial bole --batch-sizes 8 --repeats 10 --depth 6
    ;;
abhost8)  # not run yet: the token bookkeeping's fewer launches and per-row read against the forms before,
          # house model, batch 8, the tables' budgets, ten passes in turns (a warm machine: see README.md)
    STEP_SHOWS="median|Error|error" STEP_TAIL=8 step abhost8 "${ABH_S:-300}" python3 "$HERE/ab_host.py" \
        --datasets mbpp --num-prompts 8 --max-new-tokens 128 --batch-sizes 8 --depth 6 --repeats 10 --output-dir "$OUT"
    ;;
depths8)  # not run yet: tree-serial and bole at their tables ("auto"), depths 6, 7 and 8, batch 8, ten passes in turns
    house_run depths8 "${DEPTHS_S:-420}" mbpp --modes tree-serial bole --batch-sizes 8 --depth 6 7 8 --repeats 10
    ;;
host)  # cProfile of bole's and tree-serial's generate calls, house model, batch 8, the tables' budgets
    STEP_SHOWS="====" STEP_TAIL=4 step host "${HOST_S:-180}" python3 "$HERE/host_profile.py" --calls 10
    ;;
*)
    echo "unknown part $PART"
    ;;
esac
done
