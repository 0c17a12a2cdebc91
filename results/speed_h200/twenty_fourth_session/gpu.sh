#!/usr/bin/env bash
# The twenty-fourth session's GPU runs (README.md beside this file says what each measured).
# Usage, from the repository root, with fla-core's wheel in .whl/:
#   OUT=... bash results/speed_h200/twenty_fourth_session/gpu.sh PART...   (parts in turn, on one machine)
set -uo pipefail
. eval/gpu_preamble.sh
HERE=results/speed_h200/twenty_fourth_session
for PART in "$@"; do
case $PART in
ttft)  # where the house model's 44-57 ms to first token go, then the kernels of a bole and a chain call at batch 1
    STEP_SHOWS="==|median of" STEP_TAIL=40 step ttft_b1 200 python3 $HERE/ttft.py --datasets mbpp --num-prompts 8 \
        --max-new-tokens 128 --batch-sizes 1 --modes ar chain bole
    STEP_SHOWS="==|median of" STEP_TAIL=40 step ttft_b8 150 python3 $HERE/ttft.py --datasets mbpp --num-prompts 8 \
        --max-new-tokens 128 --batch-sizes 8 --modes ar bole
    STEP_SHOWS="^\|" STEP_TAIL=12 step profile_b1 150 python3 eval/profile_round.py --datasets mbpp --num-prompts 8 \
        --max-new-tokens 128 --batch-sizes 1 --modes chain bole --kernel-log "$OUT/kernels_b1"
    ;;
house)  # the README's MBPP house rows with the stop strings' criterion built once (eval/run.py), then bole's depth at
       # batch 1: each MTP step costs about 0.3 ms there and a deeper level still adds about 0.65 tokens a round
    house_run house_b1 200 mbpp --modes ar chain tree-serial bole --batch-sizes 1
    house_run house_b8 220 mbpp --modes ar chain tree-serial bole --batch-sizes 8
    house_run depth_b1 150 mbpp --modes chain bole --depth 5 6 7 8 --batch-sizes 1
    ;;
house_b1)  # call 3: the batch-1 MBPP rows again, on the machine `house` left warm (cold, they ran past 200 s)
    house_run house_b1 280 mbpp --modes ar chain tree-serial bole --batch-sizes 1
    ;;
gsm8k)  # call 4: the README's GSM8K house rows
    house_run gsm8k_b1 130 gsm8k --modes ar chain tree-serial bole --batch-sizes 1
    house_run gsm8k_b8 150 gsm8k --modes ar chain tree-serial bole --batch-sizes 8
    ;;
depth)  # call 5 (found the machine cold and ran past its limits: no figures): depth 7 against 5 at batch 8 and 1
    house_run depth_b8 150 mbpp --modes chain tree-serial bole --depth 5 7 --batch-sizes 8
    house_run depth_b1 120 mbpp --modes bole --depth 5 7 --batch-sizes 1
    ;;
*)
    echo "unknown part $PART"
    ;;
esac
done
