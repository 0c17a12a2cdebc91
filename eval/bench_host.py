"""Host time of one eager `tree_gdn_verify` call and of one ancestor-mask build (`tree_ancestor_mask`), as a forward
under `device_map` pays them at every GDN layer (CUDA graphs off there): the GPU is idle before every pass, and a
pass times N calls' return to Python (each call's GPU work is a few microseconds, so the queue never fills).

Per shape (Qwen3.5-9B's GDN layer: Hk = 16, H = 32, K = V = 128, bf16 q/k/v, fp32 state; the ancestors given, as a
model passes them), in microseconds per call, median over passes:

  verify           `tree_gdn_verify` (checks, allocations, both kernels relaunched as compiled: `CachedLaunch`)
  verify_triton    the same with every launch through Triton's own launcher (`kernel[grid]`, autotuner included)
  checks           `check_verify_inputs` alone
  launches         the verify's two kernel launches alone, relaunched as compiled with the arguments one call made
  allocations      the `torch.empty` allocations one call made (o, u, log P and the workspace), alone
                   (neither on the torch path, which makes none: null there)
  ancestors        `tree_ancestor_mask(parents)`; ancestors_triton through Triton's launcher

Usage: `python eval/bench_host.py --out runs/host.jsonl` on a GPU; `--device cpu` times the torch path (a smoke
test). One JSON line per shape after a header line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eval.bench_kernels import machine_header  # noqa: E402
from hf_bole.kernels import tree_ancestor_mask, tree_gdn_verify  # noqa: E402
from hf_bole.kernels.tree_gdn import ancestors as ancestors_module  # noqa: E402
from hf_bole.kernels.tree_gdn import closed_form_kernels  # noqa: E402
from hf_bole.kernels.tree_gdn.closed_form import check_verify_inputs  # noqa: E402
from tests.kernels.trees import make_parents  # noqa: E402

SHAPES = ((1, 16), (8, 64), (16, 64))  # (B, T)


def host_us(fn, device: str, calls: int, passes: int) -> float:
    """Median over passes of the host time of one call (us): synchronise (the GPU idle), then time `calls` calls."""
    fn()  # compile and autotune outside the timing
    times = []
    for _ in range(passes):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def through_triton(fn, launches):
    """`fn` with the compiled kernels forgotten before each call, so every launch goes through Triton's launcher."""

    def call():
        for launch in launches:
            launch.runners.clear()
        fn()

    return call


def recorded_call(fn) -> tuple[list[tuple], list[tuple]]:
    """What one call of `fn` does on the host besides Python, to time each alone: the kernel launches it makes through
    the verify's `CachedLaunch`es (each with its arguments) and the `torch.empty` allocations (each with its
    arguments)."""
    launches, allocations = [], []
    saved = {name: getattr(closed_form_kernels, name) for name in ("_SOLVE", "_APPLY")}
    empty = torch.empty

    def recording(launch):
        def record(*args):
            launches.append((launch, args))
            launch(*args)

        return record

    def allocate(*args, **kwargs):
        allocations.append((args, kwargs))
        return empty(*args, **kwargs)

    try:
        for name, launch in saved.items():
            setattr(closed_form_kernels, name, recording(launch))
        torch.empty = allocate
        fn()
    finally:
        torch.empty = empty
        for name, launch in saved.items():
            setattr(closed_form_kernels, name, launch)
    return launches, allocations


def bench_shape(B, T, HK=16, H=32, K=128, V=128, device="cuda", calls=50, passes=20) -> dict:
    gen = torch.Generator().manual_seed(T)
    q, k = (torch.randn(B, T, HK, K, generator=gen).bfloat16().to(device) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen).bfloat16().to(device)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, generator=gen) + 2.0).to(device)
    beta = torch.rand(B, T, H, generator=gen).bfloat16().to(device)
    h0 = (torch.randn(B, H, K, V, generator=gen) * 0.5).to(device)
    parents = make_parents("mixed", T, B, seed=T).to(device)
    anc = tree_ancestor_mask(parents)

    def verify():
        tree_gdn_verify(q, k, v, g, beta, parents, h0, use_qk_l2norm_in_kernel=True, ancestors=anc)

    def ancestors():
        tree_ancestor_mask(parents)

    verify_launches = (closed_form_kernels._SOLVE, closed_form_kernels._APPLY)
    row = {"op": "host", "B": B, "T": T, "H": H, "HK": HK, "K": K, "V": V, "device": device}
    with torch.no_grad():
        row["verify_us"] = host_us(verify, device, calls, passes)
        row["verify_triton_us"] = host_us(through_triton(verify, verify_launches), device, calls, passes)
        row["checks_us"] = host_us(
            lambda: check_verify_inputs(q, k, v, g, beta, parents, h0, "tf32x3"), device, calls, passes
        )
        launches, allocations = recorded_call(verify)
        row["launches_us"] = (
            host_us(lambda: [launch(*args) for launch, args in launches], device, calls, passes) if launches else None
        )
        row["allocations_us"] = (
            host_us(lambda: [torch.empty(*args, **kwargs) for args, kwargs in allocations], device, calls, passes)
            if allocations else None
        )
        row["ancestors_us"] = host_us(ancestors, device, calls, passes)
        row["ancestors_triton_us"] = host_us(
            through_triton(ancestors, (ancestors_module._ANCESTORS,)), device, calls, passes
        )
    return row


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/host.jsonl")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--shapes", nargs="+", metavar="B,T", help="these (B, T) only, e.g. 1,16")
    ap.add_argument("--calls", type=int, default=50, help="calls per timed pass")
    ap.add_argument("--passes", type=int, default=20)
    args = ap.parse_args(argv)
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes] if args.shapes else SHAPES
    header = machine_header(args.device)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    rows = []
    with open(args.out, "w") as f:
        f.write(json.dumps({"header": header}) + "\n")
        for B, T in shapes:
            rows.append(bench_shape(B, T, device=args.device, calls=args.calls, passes=args.passes))
            f.write(json.dumps(rows[-1]) + "\n")
    print(f"{header['gpu']}  torch {header['torch']}  triton {header['triton']}  commit {header['commit']}")
    print("host us per call, GPU idle; Hk=16 H=32 K=V=128 bf16; verify given the ancestors; "
          "*_triton: Triton's launcher")
    print(f"{'B':>3} {'T':>4} | {'verify':>7} {'v_triton':>8} {'checks':>7} {'launches':>8} {'allocs':>7} | "
          f"{'ancestors':>9} {'a_triton':>8}")  # fmt: skip
    for r in rows:
        launches, allocs = ("-" if r[key] is None else f"{r[key]:.1f}" for key in ("launches_us", "allocations_us"))
        print(
            f"{r['B']:>3} {r['T']:>4} | {r['verify_us']:7.1f} {r['verify_triton_us']:8.1f} {r['checks_us']:7.1f} "
            f"{launches:>8} {allocs:>7} | {r['ancestors_us']:9.1f} {r['ancestors_triton_us']:8.1f}"
        )
    return rows


if __name__ == "__main__":
    main()
