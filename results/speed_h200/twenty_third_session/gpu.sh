#!/usr/bin/env bash
# The twenty-third session's GPU runs (README.md beside this file says what each measured).
# Usage, from the repository root, with fla-core's wheel in .whl/:
#   OUT=... bash results/speed_h200/twenty_third_session/gpu.sh PART...   (parts in turn, on one machine)
set -uo pipefail
. eval/gpu_preamble.sh
HERE=results/speed_h200/twenty_third_session
for PART in "$@"; do
case $PART in
drafter)  # the compiled drafter (the new default) on CUDA: greedy equal to plain, then compiled against eager drafting
    HF_BOLE_TEST_DEVICE=cuda step cuda_tests 150 python3 -m pytest -q -x tests/generation/test_prefill.py \
        tests/generation/test_loop.py -k "greedy_matches_plain_mtp or prefill or compiles_on_cuda or sampling_keeps"
    STEP_SHOWS="median|turn" STEP_TAIL=14 step ab_drafter_b8 260 python3 $HERE/ab_drafter.py \
        --datasets mbpp --num-prompts 8 --max-new-tokens 128 --batch-sizes 8 --repeats 5 --output-dir "$OUT"
    STEP_SHOWS="median|turn" STEP_TAIL=14 step ab_drafter_b1 160 python3 $HERE/ab_drafter.py \
        --datasets mbpp --num-prompts 8 --max-new-tokens 128 --batch-sizes 1 --repeats 5 --output-dir "$OUT"
    ;;
final)  # the CUDA tests cut short in `drafter` (cold Triton and inductor caches), then the README's MBPP house rows
    HF_BOLE_TEST_DEVICE=cuda step cuda_tests 170 python3 -m pytest -q -x tests/generation/test_loop.py \
        -k "greedy_matches_plain_mtp or compiles_on_cuda"
    house_run house 300 mbpp --modes ar chain tree-serial bole --batch-sizes 1 8
    ;;
house)  # the README's MBPP house rows with this session's defaults (calls 4 and 5, each run on its own)
    house_run house_b8 340 mbpp --modes ar chain tree-serial bole --batch-sizes 8
    house_run house_b1 230 mbpp --modes ar chain tree-serial bole --batch-sizes 1
    ;;
*)
    echo "unknown part $PART"
    ;;
esac
done
