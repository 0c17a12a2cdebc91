"""The MTP drafter's masked attention over its CUDA graph's whole cache (before) against reading each row only up to
its slots in use (`masked_attention(..., lengths=)`, now), side by side on one GPU, at the house model's drafting
shapes on MBPP.

Under CUDA graphs the drafter's attention spans the cache's capacity: 1 trash + scratch + 1280 committed slots for
prompts of 667-907 tokens and 128 new (1290 for chain, depth 10; 1317 for bole, topk 4). A row uses offset + its
committed entries, here 1 + scratch + 950. Each call is timed as CUDA-graph replays over 4 input sets (median of 30,
`eval.bench_kernels.time_graph`), after checking both against float64.

    python results/speed_h200/thirty_ninth_session/bound_ab.py --out $OUT/bound_ab.jsonl
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from eval.bench_kernels import machine_header, time_graph
from hf_bole.kernels import attention
from tests.kernels.test_attention import masked_inputs
from tests.kernels.trees import rel_err

COMMITTED = 950
# name: (B, H, Hkv, Q, L, D, scratch)
SHAPES = {
    "house drafter step, chain d10, batch 1": (1, 4, 2, 1, 1290, 64, 9),
    "house drafter step, topk 4 d10, batch 1": (1, 4, 2, 4, 1317, 64, 36),
    "house drafter step, topk 4 d10, batch 8": (8, 4, 2, 4, 1317, 64, 36),
    "house drafter extension, 11 entries, batch 1": (1, 4, 2, 11, 1317, 64, 36),
    "9B drafter step, topk 4 d10, batch 1": (1, 16, 4, 4, 1317, 256, 36),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/bound_ab.jsonl")
    ours = ap.parse_args()
    header = machine_header()
    print(header)
    rows = []
    for name, (B, H, Hkv, Q, L, D, scratch) in SHAPES.items():
        lengths = torch.full((B,), 1 + scratch + COMMITTED, dtype=torch.int64, device="cuda")
        sets = []
        for seed in range(4):
            q, k, v, mask = masked_inputs(B, H, Hkv, Q, L, D, dtype=torch.bfloat16, device="cuda", seed=seed)
            mask = mask & (torch.arange(L, device="cuda") < lengths[:, None, None])  # the drafter's masks end there
            want = attention.naive_masked_attention(*(x.double().cpu() for x in (q, k, v)), mask.cpu(), D**-0.5)
            sets.append(((q, k, v, mask), want))
        variants = {
            "before": lambda q, k, v, mask: attention.masked_attention(q, k, v, mask),
            "now": lambda q, k, v, mask, lengths=lengths: attention.masked_attention(q, k, v, mask, lengths=lengths),
        }
        row = dict(shape=name, dims=(B, H, Hkv, Q, L, D), used=int(lengths[0]), **header)
        for label, fn in variants.items():
            row[f"{label}_err"] = max(rel_err(fn(*args).float().cpu(), want) for args, want in sets)
            row[f"{label}_us"] = time_graph(fn, [args for args, _ in sets])[0] * 1e3
        rows.append(row)
        print(f"{name:46} before {row['before_us']:6.1f} us  now {row['now_us']:6.1f} us  "
              f"({row['before_us'] / row['now_us']:.2f}x)  err {row['before_err']:.1e} / {row['now_err']:.1e}")
    Path(ours.out).write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
