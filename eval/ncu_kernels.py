"""The closed form's two kernels, run a few times at given shapes with one launch config each, for Nsight Compute
(registers, spills, occupancy, stall reasons: what CUDA-event timings cannot tell). On a GPU:

    ncu --clock-control none -k regex:tree_gdn_verify --section LaunchStats --section Occupancy \
        --section SpeedOfLight --section WarpStateStats python eval/ncu_kernels.py --shapes 32,16,128 48,1,128

Each kernel's autotuner is pinned to one config (the first of `SOLVE_CONFIGS` / `APPLY_CONFIGS` unless given), so
that ncu profiles the launches that are timed, not an autotuner's trial runs.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eval.bench_kernels import bounded_depth, layer_inputs  # noqa: E402
from eval.tune_kernels import pinned  # noqa: E402
from hf_bole.kernels import tree_ancestor_mask  # noqa: E402
from hf_bole.kernels.tree_gdn import closed_form_kernels as kernels  # noqa: E402
from tests.kernels.trees import make_parents  # noqa: E402


def config(text: str, names: tuple[str, ...]) -> triton.Config:
    """`BK,w,s` (solve) or `BK,BV,w,s` (apply) as a triton.Config."""
    *sizes, warps, stages = (int(x) for x in text.split(","))
    return triton.Config(dict(zip(names, sizes, strict=True)), num_warps=warps, num_stages=stages)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", metavar="H,B,T", default=["32,16,128", "48,1,128"])
    ap.add_argument("--solve-config", metavar="BK,w,s", help="default: SOLVE_CONFIGS[0]")
    ap.add_argument("--apply-config", metavar="BK,BV,w,s", help="default: APPLY_CONFIGS[0]")
    ap.add_argument("--calls", type=int, default=2, help="calls per shape (the first compiles)")
    args = ap.parse_args()
    solve_cfg = config(args.solve_config, ("BK",)) if args.solve_config else kernels.SOLVE_CONFIGS[0]
    apply_cfg = config(args.apply_config, ("BK", "BV")) if args.apply_config else kernels.APPLY_CONFIGS[0]
    pinned(kernels.tree_gdn_verify_solve_kernel, [solve_cfg])
    pinned(kernels.tree_gdn_verify_apply_kernel.fn, [apply_cfg])
    print(f"solve {solve_cfg}\napply {apply_cfg}", flush=True)
    HK, K, V = 16, 128, 128
    for shape in args.shapes:
        H, B, T = (int(x) for x in shape.split(","))
        anc = tree_ancestor_mask(bounded_depth(make_parents("mixed", T, B, seed=T).cuda(), 8))
        q, k, v, g, beta, h0 = layer_inputs(B, T, HK, H, K, V, seed=0)
        for _ in range(args.calls):
            kernels.tree_gdn_verify_fwd(q, k, v, g, beta, anc, h0, K**-0.5, True, "tf32x3")
        torch.cuda.synchronize()
        print(f"H={H} B={B} T={T}: {args.calls} calls", flush=True)


if __name__ == "__main__":
    main()
