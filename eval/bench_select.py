"""Batch-shared node selection on the GPU, side by side in one run: `select_nodes` (the reference, about 80 small
kernels, replayed from a CUDA graph) against `select_round` (`tree_select_nodes`, one launch, what the loop runs).

Trees shaped like the MTP drafter's (`synthetic_draft_tree`: topk 4, depth 5 and 6, as the house model and the 9B
runs draft), batch 1, 8 and 16, budgets 32, 64 and 128. Every output field is checked against `select_nodes` first
(log rho to rounding); both are timed as CUDA-graph replays over rotating trees, median of 30. Usage, on a GPU:

    python eval/bench_select.py --out select.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eval.bench_kernels import machine_header, time_graph  # noqa: E402
from hf_bole.generation.budget import synthetic_draft_tree  # noqa: E402
from hf_bole.generation.select import select_nodes, select_round  # noqa: E402
from hf_bole.generation.tree import DraftTree  # noqa: E402

CAP = 127  # the decoding loop's per-row cap at these budgets


def check(tree: DraftTree, roots: torch.Tensor, budget: int) -> None:
    ref = select_nodes(tree, roots, budget, CAP)
    out = select_round(tree, roots, budget, CAP)
    for name in ("input_ids", "parents", "depths", "draft_index", "node_mask", "num_nodes"):
        if not torch.equal(getattr(out, name), getattr(ref, name)):
            raise SystemExit(f"select_round's {name} differs from select_nodes' (budget {budget})")
    torch.testing.assert_close(out.draft_log_rho, ref.draft_log_rho)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/select.jsonl")
    args = ap.parse_args()
    header = machine_header()
    rows = []
    for depth in (5, 6):
        for B in (1, 8, 16):
            gen = torch.Generator(device="cuda").manual_seed(B * 10 + depth)
            trees = [synthetic_draft_tree(B, 4, depth, gen, device="cuda") for _ in range(8)]
            roots = torch.zeros(B, dtype=torch.long, device="cuda")
            for budget in (32, 64, 128):
                for tree in trees[:2]:
                    check(tree, roots, budget)
                sets = [(t.tokens, t.parents, t.draft_logprobs) for t in trees]
                row = {"B": B, "N": trees[0].tokens.shape[1], "depth": depth, "budget": budget}
                for name, fn in (("torch", select_nodes), ("triton", select_round)):
                    row[name] = time_graph(lambda t, p, lp, fn=fn: fn(DraftTree(t, p, lp), roots, budget, CAP), sets)[0]
                rows.append(row)
                print(row, flush=True)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        for row in [{"header": header}, *rows]:
            f.write(json.dumps(row) + "\n")
    print(f"\n{header['gpu']}  torch {header['torch']}  triton {header['triton']}  commit {header['commit']}")
    print("ms per selection (median of CUDA-graph replays)")
    print(f"{'depth':>5} {'B':>3} {'N':>4} {'budget':>6} | {'torch':>7} {'triton':>7} | {'speedup':>7}")
    for r in rows:
        print(f"{r['depth']:>5} {r['B']:>3} {r['N']:>4} {r['budget']:>6} | {r['torch']:7.4f} {r['triton']:7.4f} | "
              f"{r['torch'] / r['triton']:6.1f}x")


if __name__ == "__main__":
    main()
