# Sourced by the session scripts under results/ (one device command each part): makes $OUT, installs fla-core from
# .whl/ and this checkout, prints the GPU and versions, and defines `step NAME SECONDS COMMAND...`, which runs
# COMMAND with a time limit, logs it to $OUT/NAME.log and shows the log's lines matching $STEP_SHOWS (its last
# $STEP_TAIL), `house_run` for the house model's tables (eval/run.py) and `install_tables DIR`, which puts the budget
# tables kept in DIR/tables where "auto" looks. Run from the repository root.
OUT=${OUT:-/tmp/ab}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_BOLE_CACHE=/tmp/hf_bole_cache
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site-fla .whl/fla_core-*.whl
export PYTHONPATH=/tmp/site-fla:$PYTHONPATH
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip install -e . failed"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
STEP_SHOWS=${STEP_SHOWS:-"passed|failed|FAILED|Error"}
STEP_TAIL=${STEP_TAIL:-6}
step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most ${limit} s)"
    local start=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "exit $?, $((SECONDS - start)) s" | tee -a "$OUT/$name.log"
    grep -E "$STEP_SHOWS" "$OUT/$name.log" | tail -"$STEP_TAIL"
}
house_run() {  # house_run NAME SECONDS DATASET ARGS...: eval/run.py on the house model, 8 prompts of DATASET, 128 new
               # tokens, profiled (HOUSE_PROFILE= turns it off), passes in turns, into $OUT/NAME; its plots, per-prompt
               # records and log dropped
    local name=$1 limit=$2 dataset=$3
    shift 3
    STEP_SHOWS="^\| $dataset|NOT a tie" STEP_TAIL=30 step "$name" "$limit" python3 eval/run.py --datasets "$dataset" \
        --num-prompts 8 --max-new-tokens 128 ${HOUSE_PROFILE---profile} --interleave --output-dir "$OUT/$name" "$@"
    rm -f "$OUT/$name"/*.png "$OUT/$name"/results.jsonl "$OUT/$name"/run.log
}
install_tables() {  # install_tables DIR: the budget tables kept in DIR/tables, into $HF_BOLE_CACHE/budgets
    mkdir -p "$HF_BOLE_CACHE/budgets"
    cp "$1"/tables/*.json "$HF_BOLE_CACHE/budgets/"
}
