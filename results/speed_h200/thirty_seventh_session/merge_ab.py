"""The split-merge of hf_bole's attention kernels, a split a step (before) against chunks of splits (now), side by
side on one GPU, for the shapes the house model's rounds run at batch 1 and 8, and the 9B shape's.

"before" is the same kernel with `_merge_tiles` returning the old tiles (16 query rows, one split a step), which is
the old loop's order of loads and arithmetic. Each call is timed as CUDA-graph replays over 4 input sets (median of
30, `eval.bench_kernels.time_graph`), after checking both against float64.

    python results/speed_h200/thirty_seventh_session/merge_ab.py --out $OUT/merge_ab.jsonl
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from eval.bench_kernels import machine_header, time_graph
from hf_bole.kernels import attention
from tests.kernels.test_attention import attention_inputs, gold, masked_inputs
from tests.kernels.trees import rel_err

# name: masked (B, H, Hkv, Q, L, D) or tree (B, H, Hkv, N, C, D)
SHAPES = {
    "house drafter step, chain, batch 1": ("masked", (1, 4, 2, 1, 1040, 64)),
    "house drafter step, topk 4, batch 1": ("masked", (1, 4, 2, 4, 1040, 64)),
    "house drafter step, topk 4, batch 8": ("masked", (8, 4, 2, 4, 1040, 64)),
    "house verify, 32 nodes, batch 1": ("tree", (1, 4, 2, 32, 1040, 64)),
    "9B drafter step, topk 4, batch 1": ("masked", (1, 16, 4, 4, 1040, 256)),
    "9B verify, 32 nodes, batch 1": ("tree", (1, 16, 4, 32, 1040, 256)),
}


def case(kind, shape, seed):
    if kind == "masked":
        B, H, Hkv, Q, L, D = shape
        q, k, v, mask = masked_inputs(B, H, Hkv, Q, L, D, dtype=torch.bfloat16, device="cuda", seed=seed)
        args = (q, k, v, mask)
        want = attention.naive_masked_attention(*(x.double().cpu() for x in (q, k, v)), mask.cpu(), D**-0.5)
        return args, want, lambda *a: attention.masked_attention(*a)
    B, H, Hkv, N, C, D = shape
    q, k, v, lengths, valid, anc, _ = attention_inputs("mixed", B, H, Hkv, N, C, D, dtype=torch.bfloat16,
                                                       device="cuda", seed=seed)  # fmt: skip
    return (q, k, v, lengths, valid, anc), gold(q, k, v, lengths, valid, anc), lambda *a: attention.tree_attention(*a)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/merge_ab.jsonl")
    ours = ap.parse_args()
    header = machine_header()
    print(header)
    now = attention._merge_tiles
    variants = {"before": lambda M, block_d, num_splits: (attention.MERGE_BLOCK_M, 1), "now": now}
    rows = []
    for name, (kind, shape) in SHAPES.items():
        sets = [case(kind, shape, seed) for seed in range(4)]
        row = dict(shape=name, kind=kind, dims=shape, **header)
        for label, tiles in variants.items():
            attention._merge_tiles = tiles
            fn = sets[0][2]
            row[f"{label}_err"] = max(rel_err(fn(*args).float().cpu(), want) for args, want, _ in sets)
            row[f"{label}_us"] = time_graph(fn, [args for args, _, _ in sets])[0] * 1e3
        attention._merge_tiles = now
        rows.append(row)
        print(f"{name:40} before {row['before_us']:6.1f} us  now {row['now_us']:6.1f} us  "
              f"({row['before_us'] / row['now_us']:.2f}x)  err {row['before_err']:.1e} / {row['now_err']:.1e}")
    Path(ours.out).write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
