#!/usr/bin/env bash
# bole's speed on this tree against another tree of hf_bole (BASE: e.g. the commit before a change, unpacked with
# `git archive <commit> | tar -x -C /tmp/base`), on one GPU, in turns: for every pass and case, BASE's run then this
# tree's, each in a fresh process, so that both see the same machine state. From the repository root:
#
#     bash eval/ab.sh BASE [CASE...]        CASE: house1 house8 (the house model, MBPP, batch 1 / 8) and 9b1 (the
#                                           random 9B shape, oracle drafter, batch 1); all three by default
#
# PASSES (default 3) sets the passes, AB_EXTRA adds eval/run.py arguments to every run. Prints every run's tokens/s
# and, per case, both trees' medians and the ratio this / base; each run's rows go to
# runs/ab/<tree>_<case>_<pass>/results.jsonl.
set -uo pipefail
[ $# -ge 1 ] && [ -d "$1/hf_bole" ] || { sed -n '2,11p' "$0"; exit 2; }
BASE=$(cd "$1" && pwd)
shift
CASES=${*:-house1 house8 9b1}
HERE=$PWD
OUT=$HERE/runs/ab
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_BOLE_CACHE=${HF_BOLE_CACHE:-/tmp/hf_bole_cache}
HOUSE="--model $HERE/eval/house/checkpoint --datasets mbpp --num-prompts 8 --max-new-tokens 128 --depth 10"
SHAPE9B="--shape 9B --max-new-tokens 128 --depth 6 --num-prompts 2"

args() {
    case $1 in
    house1) echo "$HOUSE --batch-sizes 1" ;;
    house8) echo "$HOUSE --batch-sizes 8" ;;
    9b1) echo "$SHAPE9B --batch-sizes 1" ;;
    *) echo "unknown case $1" >&2; exit 2 ;;
    esac
}

tps() {  # the bole row's output tokens per second in a run's results.jsonl
    python3 -c "import json, sys; rows = [json.loads(l) for l in open(sys.argv[1])]; \
print([r for r in rows if r['mode'].startswith('bole')][0]['output_tokens_per_s'])" "$1"
}

for CASE in $CASES; do
    for PASS in $(seq 1 "${PASSES:-3}"); do
        for TREE in base this; do
            ROOT=$([ $TREE = base ] && echo "$BASE" || echo "$HERE")
            DIR=$OUT/${TREE}_${CASE}_$PASS
            rm -rf "$DIR"
            # shellcheck disable=SC2046
            (cd "$ROOT" && PYTHONPATH=$ROOT timeout 400 python3 eval/run.py --modes bole --output-dir "$DIR" \
                $(args "$CASE") ${AB_EXTRA:-} > "$DIR.log" 2>&1) || echo "$TREE $CASE $PASS failed"
            echo "$CASE pass $PASS $TREE $(tps "$DIR/results.jsonl" 2>/dev/null) tokens/s"
        done
    done
    python3 - "$OUT" "$CASE" "${PASSES:-3}" <<'PY'
import json, statistics, sys
out, case, passes = sys.argv[1], sys.argv[2], int(sys.argv[3])
def tps(tree):
    values = []
    for p in range(1, passes + 1):
        try:
            rows = [json.loads(line) for line in open(f"{out}/{tree}_{case}_{p}/results.jsonl")]
        except OSError:
            continue
        values += [r["output_tokens_per_s"] for r in rows if r["mode"].startswith("bole")]
    return statistics.median(values) if values else None
base, this = tps("base"), tps("this")
ratio = this / base if base and this else None
print(f"{case}: base {base}, this {this} tokens/s (medians), this / base {ratio}")
PY
done
