"""The verify forward's projections at a few rows: cuBLAS (`torch.nn.functional.linear`) against hf_bole's
`skinny_linear`, side by side on one GPU, with the copy bandwidth as the ceiling.

Each product is replayed from a CUDA graph of `REPEATS` calls over `WEIGHTS` distinct weights (more bytes than the
L2 holds, so every call reads its weight from memory), median of `--trials` replays; outputs are checked against a
float64 product first, and the kernel's against itself over replays (its K splits sum in a fixed order).

    python results/speed_h200/seventeenth_session/bench_gemm.py --shape 9B --rows 8 16 32 64 --output gemm9b.jsonl

An experiment, not part of hf_bole: the kernel (`skinny_linear.py` beside this file) gained 0-12% on single products
at up to 32 rows and lost up to 15% at 64, about 0.1 ms of a 6.1 ms verify forward at 32 nodes, too little to wire
in this session (README.md beside this file).
"""

from __future__ import annotations

import argparse
import json
import statistics

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from skinny_linear import skinny_linear  # noqa: E402

# (name, N, K) of one layer's products, with projections that read one input fused (`bole_fuse_projections`).
SHAPES = {
    "9B": [
        ("gdn in_proj qkv+z+b+a", 8192 + 4096 + 32 + 32, 4096),
        ("gdn out_proj", 4096, 4096),
        ("attn q(+gate)+k+v", 8192 + 1024 + 1024, 4096),
        ("attn o_proj", 4096, 4096),
        ("mlp gate+up", 2 * 12288, 4096),
        ("mlp down", 4096, 12288),
        ("lm_head", 248320, 4096),
    ],
    "27B": [
        ("gdn in_proj qkv+z+b+a", 4096 + 6144 + 6144 + 48 + 48, 5120),
        ("gdn out_proj", 5120, 6144),
        ("mlp gate+up", 2 * 17408, 5120),
        ("mlp down", 5120, 17408),
    ],
}
REPEATS = 12
WEIGHTS = 4


def _time(fn, trials: int) -> float:
    """Median ms of one call, from graph replays of `REPEATS` calls."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPEATS):
            fn()
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / REPEATS)
    return statistics.median(times)


def copy_ceiling(trials: int) -> float:
    """TB/s of a device-to-device copy of 1 GiB, counting bytes read and written."""
    src = torch.randn(2**28, device="cuda")
    dst = torch.empty_like(src)
    ms = _time(lambda: dst.copy_(src), trials)
    return 2 * src.numel() * 4 / ms / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="9B", choices=sorted(SHAPES))
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--trials", type=int, default=30)
    parser.add_argument("--output", default=None, help="a jsonl file for the rows")
    args = parser.parse_args()
    torch.manual_seed(0)
    ceiling = copy_ceiling(args.trials)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; copy ceiling {ceiling:.2f} TB/s")
    print(f"| product | N | K | rows | cuBLAS us | TB/s | skinny us | TB/s | skinny/cuBLAS | max rel err cuBLAS / skinny |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    records = []
    for name, N, K in SHAPES[args.shape]:
        weights = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K**-0.5 for _ in range(WEIGHTS)]
        nbytes = N * K * 2
        for M in args.rows:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            ref = x.double() @ weights[0].double().T
            scale = ref.abs().max()
            errs = [float((f(x, weights[0]).double() - ref).abs().max() / scale) for f in (F.linear, skinny_linear)]
            first = skinny_linear(x, weights[0])
            same = all(torch.equal(skinny_linear(x, weights[0]), first) for _ in range(5))
            index = [0]

            def run(f):
                def call():
                    f(x, weights[index[0] % WEIGHTS])
                    index[0] += 1

                return call

            t_cublas = _time(run(F.linear), args.trials)
            t_skinny = _time(run(skinny_linear), args.trials)
            row = dict(product=name, N=N, K=K, rows=M, cublas_us=t_cublas * 1e3, skinny_us=t_skinny * 1e3,
                       cublas_tbs=nbytes / t_cublas / 1e9, skinny_tbs=nbytes / t_skinny / 1e9,
                       err_cublas=errs[0], err_skinny=errs[1], deterministic=same, copy_tbs=ceiling,
                       gpu=torch.cuda.get_device_name(), torch=torch.__version__)  # fmt: skip
            records.append(row)
            print(f"| {name} | {N} | {K} | {M} | {row['cublas_us']:.1f} | {row['cublas_tbs']:.2f} | "
                  f"{row['skinny_us']:.1f} | {row['skinny_tbs']:.2f} | {t_skinny / t_cublas:.3f} | "
                  f"{errs[0]:.1e} / {errs[1]:.1e}{'' if same else ' (replays differ)'} |")  # fmt: skip
        del weights
    if args.output:
        with open(args.output, "w") as f:
            for row in records:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
