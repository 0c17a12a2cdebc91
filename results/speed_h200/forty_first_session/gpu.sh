#!/usr/bin/env bash
# The forty-first session's GPU plan (README.md beside this file says what came of it).
# Usage, from the repository root, with fla-core's wheel in .whl/:
#   OUT=... bash results/speed_h200/forty_first_session/gpu.sh PART...   (parts in turns, on one machine)
# Budget tables: the thirty-eighth session's (each width's capacity), installed first.
set -uo pipefail
. eval/gpu_preamble.sh
install_tables results/speed_h200/thirty_eighth_session
HERE=results/speed_h200/forty_first_session
for PART in "$@"; do
case $PART in
patch|writes)  # a held-back change into this machine's copy of the working tree (each call copies it anew): the
               # commit graphs (../fortieth_session/commit_graphs.patch) or the kept token writes (kept_writes.patch)
    PATCH=$HERE/kept_writes.patch
    [ "$PART" = patch ] && PATCH=results/speed_h200/fortieth_session/commit_graphs.patch
    if git apply --check "$PATCH" 2>/dev/null; then git apply "$PATCH" && echo "applied $PATCH"
    else echo "$PATCH not applied"; fi
    ;;
prefill_tests)  # on CUDA: the chains' replayed commits (with `patch`), graphed generate over calls (kept writes)
    HF_BOLE_TEST_DEVICE=cuda step prefill_tests "${PREFILL_S:-200}" python3 -m pytest -q -p no:cacheprovider -rf \
        --tb=short tests/generation/test_prefill.py tests/generation/test_graphs.py -k "prefill or chain or generate_matches"
    ;;
mtp_tests)  # on CUDA: the drafter's chunked extension under real graphs
    HF_BOLE_TEST_DEVICE=cuda step mtp_tests "${MTP_S:-200}" python3 -m pytest -q -p no:cacheprovider -rf --tb=short \
        tests/generation/test_mtp.py -k "cuda_graphs or replayed or chunks or extension"
    ;;
ab)  # batch 1, MBPP: the first-token changes against their forms before, passes in turns (ttft_ab.py)
    STEP_SHOWS="^\||same tokens|first pass|commit graphs|Error" STEP_TAIL=24 step ab "${AB_S:-480}" python3 \
        $HERE/ttft_ab.py --datasets mbpp --num-prompts 8 --max-new-tokens 128 --repeats "${REPEATS:-6}" \
        --out "$OUT/ab.json" ${AB_MODES:+--only $AB_MODES}
    ;;
static)  # issue 8's baseline in full on the house model: `ar` and `ar-static` (static cache, compiled by
         # transformers) beside chain d10 and bole d10 ("auto" budget), MBPP, batch 1 and 8, passes in turns
    HOUSE_PROFILE= house_run static "${STATIC_S:-400}" mbpp --modes ar ar-static chain bole --batch-sizes 1 8 \
        --depth 10 --chain-depth 10 --repeats "${REPEATS:-3}"
    ;;
*)
    echo "unknown part $PART"
    ;;
esac
done
