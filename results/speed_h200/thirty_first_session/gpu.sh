#!/usr/bin/env bash
# The thirty-first session's GPU runs (README.md beside this file says what each measured).
# Usage, from the repository root, with fla-core's wheel in .whl/:
#   OUT=... bash results/speed_h200/thirty_first_session/gpu.sh PART...   (parts in turn, on one machine)
# Budget tables: the twenty-seventh session's are installed first; `calibrate` writes new ones to $OUT and installs
# them in their place for the parts after it on the same machine.
set -uo pipefail
. eval/gpu_preamble.sh
mkdir -p "$HF_BOLE_CACHE/budgets"
cp results/speed_h200/twenty_seventh_session/tables/*.json "$HF_BOLE_CACHE/budgets/"
NODES="0 8 16 32 64 96 128 192 256 384 512"
for PART in "$@"; do
case $PART in
confirm)  # issue 8's ratio with `ar` beside it, for equality with plain greedy with the norm kernels: batch 8,
          # depth 6 (each one's best in three of the last session's four sweeps), budgets 64, 128 and 256, ten passes
          # in turns (a pass is one 0.1 s batch here; on a fresh machine the seven warm-ups take most of the time)
    house_run confirm "${CONFIRM_S:-420}" mbpp --modes ar tree-serial bole --batch-sizes 8 --depth 6 \
        --budget 64 128 256 --repeats 10
    ;;
calibrate)  # the house model's tables after the drafter's and the norms' kernels, closed form and serial verify;
            # installed for the parts after it
    STEP_SHOWS="^ +[0-9]|wrote|Error" STEP_TAIL=12 step cal_closed "${CAL_S:-200}" python3 -m hf_bole.calibrate \
        --model eval/house/checkpoint --dtype bf16 --batch-sizes 1 4 8 16 --kv-lengths 1024 --nodes $NODES --reps 5 \
        --out "$OUT/house_closed_form.json"
    STEP_SHOWS="^ +[0-9]|wrote|Error" STEP_TAIL=12 step cal_serial "${CAL_SERIAL_S:-120}" python3 -m hf_bole.calibrate \
        --model eval/house/checkpoint --dtype bf16 --batch-sizes 1 8 --kv-lengths 1024 --nodes $NODES --reps 5 \
        --verify serial --out "$OUT/house_serial.json"
    ;;
auto)  # every mode at the tables' budgets ("auto", the default), batches 1 and 8 (call 3: cut during batch 8)
    house_run auto "${AUTO_S:-240}" mbpp --modes ar chain tree-serial bole --batch-sizes 1 8
    ;;
auto8)  # the same at batch 8 alone, depth 6, ten passes (call 4 ran this line from the command line)
    house_run auto8 "${AUTO_S:-230}" mbpp --modes ar chain tree-serial bole --batch-sizes 8 --repeats 10 --depth 6
    ;;
floor)  # NOT RUN, for the next session as `gpu.sh calibrate floor` (CAL_S=300 on a fresh machine: call 5's
        # calibration did not finish 14 timings in 130 s there): once the budget's T_dec is the floor's forward
        # (table format 3; the twenty-seventh session's tables, format 2, are then ignored with a warning), every mode
        # at the new tables' budgets, batches 1 and 8, ten passes
    house_run floor "${FLOOR_S:-300}" mbpp --modes ar chain tree-serial bole --batch-sizes 1 8 --repeats 10 --depth 6
    ;;
*)
    echo "unknown part $PART"
    ;;
esac
done
