#!/usr/bin/env bash
# The thirty-eighth session's GPU plan (README.md beside this file says what came of it).
# Usage, from the repository root, with fla-core's wheel in .whl/:
#   OUT=... bash results/speed_h200/thirty_eighth_session/gpu.sh PART...   (parts in turns, on one machine)
# Budget tables: the thirty-third session's, format 4 (its tables/ folder), installed first.
set -uo pipefail
. eval/gpu_preamble.sh
install_tables results/speed_h200/thirty_third_session
HERE=results/speed_h200/thirty_eighth_session
wait1() {  # round_wait.py at batch 1 on MBPP: NAME SECONDS VARIANT...
    local name=$1 limit=$2
    shift 2
    local variants=()
    for v in "$@"; do variants+=(--variant "$v"); done
    STEP_SHOWS="^\||first pass|Error" STEP_TAIL=40 step "$name" "$limit" python3 $HERE/round_wait.py \
        --datasets mbpp --num-prompts 8 --max-new-tokens 128 --repeats "${REPEATS:-6}" --out "$OUT/$name.json" \
        "${variants[@]}"
}
for PART in "$@"; do
case $PART in
sweep1)  # chain and bole at several depths, bole narrower and with a smaller budget
    wait1 sweep1 "${SWEEP1_S:-520}" "chain d6=depth=6,topk=1,budget=6" "chain d8=depth=8,topk=1,budget=8" \
        "chain d10=depth=10,topk=1,budget=10" "bole d6=depth=6" "bole d8=depth=8" "bole d10=depth=10" \
        "bole d12=depth=12" "bole d10 k2=depth=10,topk=2" "bole d10 b16=depth=10,budget=16"
    ;;
cal)  # the house model's closed-form table again, at the default grid (roots only and each width's capacity)
    STEP_SHOWS="^ +[0-9]|wrote|Error" STEP_TAIL=12 step cal "${CAL_S:-200}" python3 -m hf_bole.calibrate \
        --model eval/house/checkpoint --dtype bf16 --batch-sizes ${CAL_BATCHES:-1 4 8 16} --kv-lengths 1024 --reps 5 \
        --verify closed_form
    mkdir -p "$OUT/tables" && cp "$HF_BOLE_CACHE"/budgets/*closed_form*.json "$OUT/tables/"
    ;;
sweep2)  # after cal: chain at 8 and 10 against bole at 10 with the new table ("auto") and at 31 and 63 nodes
    wait1 sweep2 "${SWEEP2_S:-420}" "chain d8=depth=8,topk=1,budget=8" "chain d10=depth=10,topk=1,budget=10" \
        "bole d10=depth=10" "bole d10 b31=depth=10,budget=31" "bole d10 b63=depth=10,budget=63"
    ;;
b8)  # batch 8, depth 10: chain against bole at the table's budget ("auto") and at 384 (the thirty-third's choice)
    HOUSE_PROFILE= house_run b8 "${B8_S:-230}" mbpp --modes chain bole --batch-sizes 8 --depth 10 --chain-depth 10 \
        --budget auto 384 --repeats 3
    ;;
prefill1)  # not run yet: the prompt through transformers' forward ("plain") against chains ("auto"), batch 1, with
          # the rounds and the first token apart; the first token is a third of a batch-1 call, and it is the host's
    wait1 prefill1 "${PREFILL1_S:-420}" "chain d10=depth=10,topk=1,budget=10" \
        "chain d10 plain=depth=10,topk=1,budget=10,prefill=plain" "bole d10=depth=10" "bole d10 plain=depth=10,prefill=plain"
    ;;
caches)  # how large the compile caches a fresh machine fills are (carrying them would save its warm-up)
    du -sh /tmp/torchinductor_* ~/.triton/cache 2>/dev/null
    ;;
*)
    echo "unknown part $PART"
    ;;
esac
done
