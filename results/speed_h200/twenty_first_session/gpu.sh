#!/usr/bin/env bash
# The twenty-first session's GPU runs (README.md beside this file says what each measured).
# Usage, from the repository root, with fla-core's wheel in .whl/:
#   OUT=... bash results/speed_h200/twenty_first_session/gpu.sh PART...   (parts in turn, on one machine)
# At most 8 files come back from a device command. `savecache` packs Triton's and inductor's on-disk caches into
# $OUT (two 14 MiB pieces at most); a later call on a fresh machine that carries them (.compile_cache/) unpacks them
# first and skips most of the compiled modes' minutes of compiling.
set -uo pipefail
if ls .compile_cache/cache.tgz.* >/dev/null 2>&1; then
    cat .compile_cache/cache.tgz.* | tar xzf - -C / && echo "compile caches unpacked ($(du -sh /tmp/torchinductor_root | cut -f1) inductor)"
fi
. eval/gpu_preamble.sh
house() {  # house NAME SECONDS ARGS...: the house model on 8 MBPP prompts, 128 new tokens, passes in turns
    local name=$1 limit=$2
    shift 2
    STEP_SHOWS="^\| mbpp|NOT a tie" STEP_TAIL=30 step "$name" "$limit" python3 eval/run.py --datasets mbpp \
        --num-prompts 8 --max-new-tokens 128 --profile --interleave --output-dir "$OUT/$name" "$@"
    rm -f "$OUT/$name"/*.png "$OUT/$name"/results.jsonl "$OUT/$name"/run.log
}
ab() {  # ab NAME SECONDS ARGS...: the drafter before and after this session, passes in turns (ab_drafter.py)
    local name=$1 limit=$2
    shift 2
    STEP_SHOWS="median|turn" STEP_TAIL=12 step "$name" "$limit" python3 results/speed_h200/twenty_first_session/ab_drafter.py \
        --datasets mbpp --num-prompts 8 --max-new-tokens 128 --output-dir "$OUT/$name" "$@"
    rm -rf "${OUT:?}/$name"
}
for PART in "$@"; do
case $PART in
fixtest)  # the compiled-path fix (315dbd0) on the GPU: inductor over two KV capacities, every attention layer
    HF_BOLE_TEST_DEVICE=cuda step fixtest 120 python3 -m pytest -q -x tests/models/test_qwen3_5.py \
        -k "inductor_graph_with_the_capacity_symbolic or compiled"
    ;;
house_b1c)  # house, batch 1, compiled ar/chain/bole with the fix: issue 8's bole >= 1.2x chain at batch 1
    house house_b1_compiled 450 --modes ar chain bole --batch-sizes 1 --compile on
    ;;
house_b8c)  # house, batch 8, compiled chain/tree-serial/bole and ar: issue 8's bole >= 1.3x tree-serial
    house house_b8_compiled 450 --modes ar chain tree-serial bole --batch-sizes 8 --compile on
    ;;
drafter)  # call 4: the drafter's attention and top-k (this session's change) on the GPU, then the house tables eager
    HF_BOLE_TEST_DEVICE=cuda step mtp_tests 100 python3 -m pytest -q tests/generation/test_mtp.py
    ab ab_b8 100 --batch-sizes 8 --repeats 5
    house house_b8_eager 130 --modes ar chain tree-serial bole --batch-sizes 8
    ab ab_b1 70 --batch-sizes 1 --repeats 7
    house house_b1_eager 100 --modes ar chain tree-serial bole --batch-sizes 1
    ;;
savecache)
    tar czf /tmp/cache.tgz -C / tmp/torchinductor_root root/.triton/cache 2>/dev/null
    size=$(stat -c %s /tmp/cache.tgz)
    echo "compile caches: $((size / 1048576)) MiB packed"
    if [ "$size" -le $((28 * 1048576)) ]; then
        split -b 14M /tmp/cache.tgz "$OUT/cache.tgz."
    else
        echo "too large to carry back; not saved"
    fi
    ;;
*)
    echo "unknown part $PART"
    ;;
esac
done
