#!/usr/bin/env bash
# The thirty-ninth session's GPU plan (README.md beside this file says what came of it).
# Usage, from the repository root, with fla-core's wheel in .whl/:
#   OUT=... bash results/speed_h200/thirty_ninth_session/gpu.sh PART...   (parts in turns, on one machine)
# Budget tables: the thirty-eighth session's (each width's capacity), installed first.
set -uo pipefail
. eval/gpu_preamble.sh
install_tables results/speed_h200/thirty_eighth_session
HERE=results/speed_h200/thirty_ninth_session
WAIT=results/speed_h200/thirty_eighth_session/round_wait.py
wait1() {  # round_wait.py at batch 1 on MBPP: NAME SECONDS VARIANT...
    local name=$1 limit=$2
    shift 2
    local variants=()
    for v in "$@"; do variants+=(--variant "$v"); done
    STEP_SHOWS="^\||first pass|Error" STEP_TAIL=40 step "$name" "$limit" python3 $WAIT \
        --datasets mbpp --num-prompts 8 --max-new-tokens 128 --repeats "${REPEATS:-4}" --out "$OUT/$name.json" \
        "${variants[@]}"
}
for PART in "$@"; do
case $PART in
tests)  # the drafter's code on CUDA: the attention kernels (masked attention's lengths), then the MTP drafter's tests
        # (the rotary embedding once a round, the key lengths) with every tensor on the GPU
    step attn_tests "${ATTN_S:-120}" python3 -m pytest -q -p no:cacheprovider -rf --tb=short tests/kernels/test_attention.py
    HF_BOLE_TEST_DEVICE=cuda step mtp_tests "${MTP_S:-240}" python3 -m pytest -q -p no:cacheprovider -rf --tb=short \
        tests/generation/test_mtp.py
    ;;
bound)  # masked attention over the graph's whole cache against up to each row's slots in use (bound_ab.py)
    STEP_SHOWS="drafter|Error" STEP_TAIL=10 step bound "${BOUND_S:-120}" python3 $HERE/bound_ab.py --out "$OUT/bound_ab.jsonl"
    ;;
sweep)  # batch 1: chain at 8 and 10 against bole at 10 with 31 and 63 nodes, and bole with transformers' prefill
    wait1 sweep "${SWEEP_S:-330}" "chain d8=depth=8,topk=1,budget=8" "chain d10=depth=10,topk=1,budget=10" \
        "bole d10 b31=depth=10,budget=31" "bole d10 b63=depth=10,budget=63" \
        "bole d10 b31 plain=depth=10,budget=31,prefill=plain"
    ;;
*)
    echo "unknown part $PART"
    ;;
esac
done
