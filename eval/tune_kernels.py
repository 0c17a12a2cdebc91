"""Which launch configs of the closed form's kernels are fastest on this GPU: every config of a search space timed
on its own, beside the autotuned choice (`closed_form_kernels.SOLVE_CONFIGS`, `APPLY_CONFIGS`).

For each shape, each solve config is timed alone (`solve`), then each apply config on the whole layer with the
best solve config fixed; every config's output is checked against the float64 closed form first, and a config that
fails to compile or strays is listed, not timed. Inputs, trees and timing as `eval/bench_kernels.py` (CUDA-graph
replays over rotating input sets, median of 30). Usage, on a GPU:

    python eval/tune_kernels.py --shapes 32,16,128 48,1,128 --out tune.jsonl

What it prints last is the table to choose the configs from; put the winners in closed_form_kernels.py.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eval.bench_kernels import (  # noqa: E402
    bounded_depth,
    chosen_configs,
    describe,
    machine_header,
    rel_err,
    rotating_inputs,
    time_graph,
)
from hf_bole.kernels import tree_ancestor_mask  # noqa: E402
from hf_bole.kernels.tree_gdn import closed_form_kernels as kernels  # noqa: E402
from hf_bole.kernels.tree_gdn.closed_form import torch_tree_gdn_verify  # noqa: E402
from tests.kernels.trees import make_parents  # noqa: E402

# The search space. Measured on an H200 at T = 128: 8 warps took 1.6-2x as long as 4
# in both kernels, BV = 16 1.4-1.6x, and with num_stages=2 the solve kernel strayed from float64 and the apply kernel
# made an illegal memory access (which leaves the CUDA context unusable for every later config; cause not
# isolated), so none of those is searched again.
SOLVE_SPACE = [triton.Config({"BK": BK}, num_warps=4, num_stages=1) for BK in (128, 64)]
APPLY_SPACE = [
    triton.Config({"BK": BK, "BV": BV}, num_warps=w, num_stages=1)
    for BV, BK, w in ((32, 64, 4), (32, 32, 4), (32, 16, 4), (64, 64, 4), (64, 32, 4), (64, 16, 4), (64, 32, 8), (64, 16, 8))
]  # without the norms' registers (branch wip-norms), smaller K steps and 8 warps spill less: worth timing again


def pinned(autotuner, configs: list[triton.Config]):
    """Makes `autotuner` (a Triton Autotuner) choose among `configs` only, forgetting its earlier choices."""
    autotuner.configs = configs
    autotuner.cache = {}


def tune_shape(H: int, B: int, T: int, HK: int = 16, K: int = 128, V: int = 128, depth: int = 8):
    """Yields one row per config as it is measured (so a run cut short keeps what it finished)."""
    parents = bounded_depth(make_parents("mixed", T, B, seed=T).cuda(), depth)
    anc = tree_ancestor_mask(parents)
    sets = rotating_inputs(B, T, HK, H, K, V)
    q, k, v, g, beta, h0 = sets[0]
    ref_o, ref_u, _ = torch_tree_gdn_verify(*(x.double() for x in (q, k, v, g, beta)), anc, h0.double(), K**-0.5, True)
    solve_kernel, apply_kernel = kernels.tree_gdn_verify_solve_kernel, kernels.tree_gdn_verify_apply_kernel.fn
    tuned = (list(solve_kernel.configs), list(apply_kernel.configs))

    def layer(q, k, v, g, b, h):
        return kernels.tree_gdn_verify_fwd(q, k, v, g, b, anc, h, K**-0.5, True, "tf32x3")

    def check(name: str, config: triton.Config) -> dict:
        row = {"H": H, "B": B, "T": T, "kernel": name, "config": describe(config)}
        try:
            o, u, _ = layer(q, k, v, g, beta, h0)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 -- a config that does not compile (registers, shared memory) is listed
            return {**row, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        err_o, err_u = rel_err(o, ref_o), rel_err(u, ref_u)
        if not (err_o <= 1e-2 and err_u <= 1e-5):
            return {**row, "error": f"strays from float64: o {err_o:.2e}, u {err_u:.2e}"}
        return row

    solve_times = []  # (ms, config) of the solve configs that ran
    try:
        pinned(apply_kernel, tuned[1][:1])
        for config in SOLVE_SPACE:
            pinned(solve_kernel, [config])
            row = check("solve", config)
            if "error" not in row:
                row["ms"] = time_graph(lambda q, k, v, g, b, h: kernels.solve(q, k, H, g, b, anc, True, "tf32x3"), sets)[0]
                solve_times.append((row["ms"], config))
            yield row
        pinned(solve_kernel, [min(solve_times, key=lambda t: t[0])[1]])
        for config in APPLY_SPACE:
            pinned(apply_kernel, [config])
            row = check("layer", config)
            if "error" not in row:
                row["ms"] = time_graph(layer, sets)[0]
            yield row
        pinned(solve_kernel, tuned[0])
        pinned(apply_kernel, tuned[1])  # what tree_gdn_verify runs: the autotuner's pick among the committed configs
        ms = time_graph(layer, sets)[0]
        yield {"H": H, "B": B, "T": T, "kernel": "layer", "config": "autotuned", "ms": ms, "chosen": chosen_configs()}
    finally:
        pinned(solve_kernel, tuned[0])
        pinned(apply_kernel, tuned[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", metavar="H,B,T", default=["32,16,128", "48,1,128"])
    ap.add_argument("--out", default="runs/tune_kernels.jsonl")
    args = ap.parse_args()
    header = machine_header()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    table = []
    with open(args.out, "w") as f:
        f.write(json.dumps({"header": header}) + "\n")
        for shape in args.shapes:
            H, B, T = (int(x) for x in shape.split(","))
            for row in tune_shape(H, B, T):
                print(row, flush=True)
                f.write(json.dumps(row) + "\n")
                f.flush()
                table.append(row)
    print(f"\n{header['gpu']}  torch {header['torch']}  triton {header['triton']}  commit {header['commit']}")
    print("ms per layer (median of CUDA-graph replays); solve rows: the solve kernel alone; layer rows: both kernels")
    for (H, B, T, kernel), group in itertools.groupby(table, key=lambda r: (r["H"], r["B"], r["T"], r["kernel"])):
        group = sorted(group, key=lambda r: r.get("ms", float("inf")))
        print(f"H={H} B={B} T={T} {kernel}:")
        for r in group[:5] + [r for r in group[5:] if r["config"] == "autotuned" or "error" in r]:
            print(f"  {r['config']:<32} {r.get('ms', float('nan')):8.4f}  {r.get('error', r.get('chosen', ''))}")


if __name__ == "__main__":
    main()
