#!/usr/bin/env bash
# The twenty-fifth session's GPU runs (README.md beside this file says what each measured).
# Usage, from the repository root, with fla-core's wheel in .whl/:
#   OUT=... bash results/speed_h200/twenty_fifth_session/gpu.sh PART...   (parts in turn, on one machine)
set -uo pipefail
. eval/gpu_preamble.sh
for PART in "$@"; do
case $PART in
tests)  # the MTP drafter's and the loop's tests on CUDA (graphs, compile, the prompt's split extension)
    HF_BOLE_TEST_DEVICE=cuda step tests 240 python3 -m pytest -q -x tests/generation/test_mtp.py \
        tests/generation/test_loop.py
    ;;
profile_test)  # call 2: the phase timer's test again, its host-clock check fixed for CUDA
    HF_BOLE_TEST_DEVICE=cuda step profile_test 90 python3 -m pytest -q tests/generation/test_loop.py -k profile
    ;;
mbpp)  # the README's MBPP house rows: the drafter's first call replays a round's graph; host times per phase
    house_run mbpp_b1 280 mbpp --modes ar chain tree-serial bole --batch-sizes 1
    ;;
mbpp_b8)
    house_run mbpp_b8 150 mbpp --modes ar chain tree-serial bole --batch-sizes 8
    ;;
gsm8k)  # the README's GSM8K house rows
    house_run gsm8k_b1 170 gsm8k --modes ar chain tree-serial bole --batch-sizes 1
    house_run gsm8k_b8 170 gsm8k --modes ar chain tree-serial bole --batch-sizes 8
    ;;
depth)  # depth 7 against 5 at batch 8 (tree-serial's cost grows with the nodes, bole's hardly)
    house_run depth_b8 200 mbpp --modes chain tree-serial bole --depth 5 7 --batch-sizes 8
    ;;
ttft)  # the drafter's first call (now: eager extension but for the last depth + 1 entries, then a replayed round)
    STEP_SHOWS="==|median of" STEP_TAIL=30 step ttft_b1 150 python3 results/speed_h200/twenty_fourth_session/ttft.py \
        --datasets mbpp --num-prompts 8 --max-new-tokens 128 --batch-sizes 1 --modes chain bole
    ;;
host)  # cProfile of warm bole and chain calls at batch 1: where the host's time in a round goes
    STEP_SHOWS="==|tottime|cumtime" STEP_TAIL=8 step host_b1 200 python3 results/speed_h200/twenty_fifth_session/host_profile.py \
        --datasets mbpp --num-prompts 4 --max-new-tokens 128 --batch-sizes 1 --modes bole chain
    ;;
*)
    echo "unknown part $PART"
    ;;
esac
done
