#!/usr/bin/env bash
# Thirteenth session's GPU calls 2-4 (README.md beside this file). call2: end-to-end runs of this tree ("new": one-launch
# selection, fewer copies in the verify forward) and of main before the session (wip/base, untracked:
# `mkdir -p wip/base && git archive 5f03297 hf_bole eval pyproject.toml | tar -x -C wip/base`), one after the other;
# call3 and call4: kernel and model tests on CUDA, and ab_select.py (selection swapped inside one process).
# Usage, from the repository root: OUT=... bash results/speed_h200/thirteenth_session/ab_e2e.sh PART
set -uo pipefail
PART=$1
STEP_SHOWS="passed|failed|FAILED|Error|hf_bole from|tok/s" STEP_TAIL=8
. eval/gpu_preamble.sh
variant() {  # variant new|base NAME SECONDS ARGS...: eval/run.py of that tree, rows to $OUT/NAME.jsonl
    local v=$1 name=$2 limit=$3
    shift 3
    local root=$PWD
    [ "$v" = base ] && root=$PWD/wip/base
    step "$name" "$limit" bash -c "cd $root && python3 -c 'import sys; sys.path.insert(0, \".\"); import hf_bole; print(\"hf_bole from\", hf_bole.__file__)' && python3 eval/run.py --output-dir /tmp/$name $*"
    cp "/tmp/$name/results.jsonl" "$OUT/$name.jsonl" 2>/dev/null || cp "/tmp/$name/results.partial.jsonl" "$OUT/$name.jsonl" 2>/dev/null
}
B1="--shape 9B --depth 6 --max-new-tokens 256 --profile --modes bole --batch-sizes 1 --num-prompts 2 --repeats 3 --compile off on"
B8="--shape 9B --depth 6 --max-new-tokens 256 --profile --modes bole --batch-sizes 8 --num-prompts 8 --repeats 3"
case $PART in
call2)
    variant new b1_new 270 $B1
    variant base b1_base 270 $B1
    ;;
call3)
    step tests 100 python3 -m pytest -q -p no:cacheprovider -n 8 tests/kernels/test_tree_conv.py \
        tests/kernels/test_closed_form.py -k "strided or conv or chain-T33 or mixed"
    AB="python3 results/speed_h200/thirteenth_session/ab_select.py --output-dir $OUT"
    step ab_house_b1 90 $AB --datasets gsm8k --max-new-tokens 128 --batch-sizes 1 --num-prompts 4 --repeats 5
    step ab_9b_b1 170 $AB --shape 9B --depth 6 --max-new-tokens 128 --batch-sizes 1 --num-prompts 2 --repeats 7
    step ab_9b_b8 150 $AB --shape 9B --depth 6 --max-new-tokens 128 --batch-sizes 8 --num-prompts 8 --repeats 5
    grep -h -A3 "new tokens" "$OUT"/ab_*.log
    ;;
call4)
    step model_tests 150 env HF_BOLE_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider -n 8 tests/cache \
        tests/generation/test_loop.py tests/generation/test_select_kernel.py -k "not compiled and not two_gpus"
    step ab_house_b1 150 python3 results/speed_h200/thirteenth_session/ab_select.py --output-dir "$OUT" --datasets gsm8k \
        --max-new-tokens 128 --batch-sizes 1 --num-prompts 4 --repeats 5
    grep -h -A3 "new tokens" "$OUT"/ab_*.log
    ;;
esac
cd "$OUT" && tar czf ab.tgz *.log && rm -f *.log
python3 - <<'PY'
import glob, json
for f in sorted(glob.glob("*.jsonl")):
    for line in open(f):
        r = json.loads(line)
        if "output_tokens_per_s" in r:
            t = r.get("round_phase_ms") or {}
            print(f, r["mode"], "compiled" if r.get("compiled") else "eager", "B", r["batch_size"],
                  "tok/s %.1f" % (r["output_tokens_per_s"] or 0), "spread %.3f" % (r["pass_spread"] or 0),
                  "exact", r.get("exact_share"), {k: round(v, 3) for k, v in t.items()}, "total %.2f" % sum(t.values()))
PY
