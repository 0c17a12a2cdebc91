#!/usr/bin/env bash
# The fortieth session's GPU plan (README.md beside this file says what came of it).
# Usage, from the repository root, with fla-core's wheel in .whl/:
#   OUT=... bash results/speed_h200/fortieth_session/gpu.sh PART...   (parts in turns, on one machine)
# Budget tables: the thirty-eighth session's (each width's capacity), installed first.
set -uo pipefail
. eval/gpu_preamble.sh
install_tables results/speed_h200/thirty_eighth_session
HERE=results/speed_h200/fortieth_session
WAIT=results/speed_h200/thirty_eighth_session/round_wait.py
wait1() {  # round_wait.py at batch 1: NAME SECONDS DATASET VARIANT...
    local name=$1 limit=$2 dataset=$3
    shift 3
    local variants=()
    for v in "$@"; do variants+=(--variant "$v"); done
    STEP_SHOWS="^\||first pass|Error" STEP_TAIL=40 step "$name" "$limit" python3 $WAIT \
        --datasets "$dataset" --num-prompts 8 --max-new-tokens 128 --repeats "${REPEATS:-4}" --out "$OUT/$name.json" \
        "${variants[@]}"
}
for PART in "$@"; do
case $PART in
first)  # the first token on the GPU's timeline (sync debug, profiler markers) and the drafting graph's kernels
    STEP_SHOWS="^\[|^  |^    " STEP_TAIL=150 step first "${FIRST_S:-300}" python3 $HERE/first_token.py --out "$OUT/first"
    ;;
gsm)  # batch 1 on GSM8K: chain at 8 and 10 against bole at 10 with 31 and 63 nodes
    wait1 gsm "${GSM_S:-240}" gsm8k "chain d8=depth=8,topk=1,budget=8" "chain d10=depth=10,topk=1,budget=10" \
        "bole d10 b31=depth=10,budget=31" "bole d10 b63=depth=10,budget=63"
    ;;
tests)  # on CUDA: the drafter's chunked extension under real graphs, the chains' replayed commits, graphed generate
    HF_BOLE_TEST_DEVICE=cuda step mtp_tests "${MTP_S:-200}" python3 -m pytest -q -p no:cacheprovider -rf --tb=short \
        tests/generation/test_mtp.py -k "cuda_graphs or replayed or chunks or extension"
    HF_BOLE_TEST_DEVICE=cuda step prefill_tests "${PREFILL_S:-200}" python3 -m pytest -q -p no:cacheprovider -rf \
        --tb=short tests/generation/test_prefill.py tests/generation/test_graphs.py -k "prefill or chain or generate_matches"
    ;;
ab)  # batch 1, MBPP: the two first-token changes against their forms before, passes in turns (ttft_ab.py)
    STEP_SHOWS="^\||same tokens|first pass|Error" STEP_TAIL=20 step ab "${AB_S:-480}" python3 $HERE/ttft_ab.py \
        --datasets mbpp --num-prompts 8 --max-new-tokens 128 --repeats "${REPEATS:-6}" --out "$OUT/ab.json"
    ;;
*)
    echo "unknown part $PART"
    ;;
esac
done
