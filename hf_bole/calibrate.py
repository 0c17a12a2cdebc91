"""Measures the verification budget table of a model on this GPU (DESIGN.md §5; the logic is in
`hf_bole.generation.budget`), so that `generate(..., bole_budget="auto")` finds it.

    python -m hf_bole.calibrate --model Qwen/Qwen3.5-9B --dtype bf16
    python -m hf_bole.calibrate --shape 9B --batch-sizes 1 4 8 16 32 64 128 256 --kv-lengths 1024 --out budget_9b.json
    torchrun --nproc-per-node 2 -m hf_bole.calibrate --shape 122B-A10B   # tensor-parallel over 2 GPUs

Writes the table to `$HF_BOLE_CACHE/budgets/<key>.json` (default `~/.cache/hf_bole/budgets/`), where "auto" looks
first (or into `--table-dir`: `hf_bole/budgets` in a clone ships it with the package), and to `--out` if given,
after every (batch size, KV length) bucket it finishes and once more at the end, plus a
PNG of a round's cost against N (`--plot`, default: beside the JSON; needs matplotlib). `--shape` builds a
random-weight model of a published Qwen3.5 shape (`hf_bole.shapes`): timings do not depend on the weights, and the
table's key is the shape's, so it serves the published checkpoint of that shape. Under `torchrun` the model is
sharded over the processes by transformers' tensor parallelism (`tp_plan="auto"`; a shape through
`hf_bole.shapes.build_model_tensor_parallel`): every rank times the forwards together, the first one writes the table,
keyed by the TP degree (`TableKey.launch`: "tp<N>-...").
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import torch

from hf_bole.config import ATTENTION_MODES, VERIFY_MODES, BoleConfig
from hf_bole.generation.budget import (
    DEFAULT_BATCH_SIZES,
    DEFAULT_KV_LENGTHS,
    MAX_RATIO,
    cache_dir,
    calibrate,
    plot_table,
)
from hf_bole.shapes import SHAPES, build_model, build_model_tensor_parallel, shape_config

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = BoleConfig()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="checkpoint folder or Hub id (loaded with AutoModelForCausalLM)")
    source.add_argument("--shape", help=f"a random-weight model of a published shape ({', '.join(SHAPES)}) or of a "
                        "checkpoint folder's config.json")  # fmt: skip
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=list(DEFAULT_BATCH_SIZES))
    ap.add_argument("--kv-lengths", nargs="+", type=int, default=list(DEFAULT_KV_LENGTHS))
    ap.add_argument("--nodes", nargs="+", type=int,
                    help="total draft nodes per verify forward (0: roots only); default: roots only and, per batch "
                         "size, the most nodes each verify width holds (hf_bole.generation.budget.capacities)")  # fmt: skip
    ap.add_argument(
        "--epsilon", type=float, default=defaults.epsilon, help="B_ver = max{N : T(N) <= (1+eps) T(floor)}, 0 where "
        "T(floor) > (1+eps) T(0), T = T_ver + T_commit (hf_bole.generation.budget.rule)"
    )
    ap.add_argument("--verify", choices=VERIFY_MODES, default=defaults.verify)
    ap.add_argument(
        "--no-cuda-graphs", dest="cuda_graphs", action="store_false", help="time forwards launched from Python, for "
        "generate(..., bole_cuda_graphs=False) (default: replayed from CUDA graphs, as generate runs them)",
    )  # fmt: skip
    ap.add_argument(
        "--compile", action="store_true", help="time the torch.compile'd verify forward, for generate(..., "
        "bole_compile=True) (it compiles first: a minute or more on a large model)",
    )  # fmt: skip
    ap.add_argument(
        "--attention", choices=ATTENTION_MODES, default=defaults.attention, help="how the verify forward's "
        "full-attention layers attend, for generate(..., bole_attention=...) (\"auto\": hf_bole's kernel on CUDA)",
    )  # fmt: skip
    ap.add_argument("--topk", type=int, default=defaults.topk, help="shape of the synthetic draft trees")
    ap.add_argument("--depth", type=int, default=defaults.depth, help="shape of the synthetic draft trees")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10, help="timed calls per median")
    ap.add_argument("--max-ratio", type=float, default=MAX_RATIO, help="a bucket's sweep stops at the first N whose "
                    "forward costs more than this many times the floor's (N = batch size)")  # fmt: skip
    ap.add_argument("--prefill-chunk", type=int, default=2048)
    ap.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, help="also write the table here")
    ap.add_argument("--plot", type=Path, help="the PNG (default: the JSON's path with .png)")
    ap.add_argument("--table-dir", type=Path, help="write <key>.json here instead of the cache folder (hf_bole/budgets: "
                    "the tables shipped with the package)")  # fmt: skip
    ap.add_argument("--no-save", action="store_true", help="do not write into the cache folder (or --table-dir)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for name in ("batch_sizes", "kv_lengths", "warmup", "reps", "prefill_chunk", "topk", "depth"):
        values = getattr(args, name)
        if any(v < 1 for v in (values if isinstance(values, list) else [values])):
            ap.error(f"--{name.replace('_', '-')} must be positive, got {values}")
    if any(n < 0 for n in args.nodes or []):
        ap.error(f"--nodes must be >= 0, got {args.nodes}")
    if not args.max_ratio > 1:
        ap.error(f"--max-ratio must be > 1, got {args.max_ratio}")
    if not args.epsilon >= 0:
        ap.error(f"--epsilon must be >= 0, got {args.epsilon}")
    if args.no_save and args.out is None:
        ap.error("--no-save needs --out: the table would be written nowhere")
    return args


def tensor_parallel_launch() -> bool:
    """Whether `torchrun` started this process among several: the model is then sharded over them."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def load_model(args: argparse.Namespace):
    dtype, device = DTYPES[args.dtype], torch.device(args.device)
    if args.shape is not None:
        if tensor_parallel_launch():
            return build_model_tensor_parallel(shape_config(args.shape), dtype, seed=args.seed)
        return build_model(shape_config(args.shape), device, dtype)
    from transformers import AutoModelForCausalLM

    if tensor_parallel_launch():
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation="sdpa", tp_plan="auto")
        return model.eval()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    model = load_model(args)

    # Under tensor parallelism every rank times, the first one writes and reports.
    first = not tensor_parallel_launch() or torch.distributed.get_rank() == 0

    def save(table) -> list[Path]:
        if not first:
            return []
        folder = args.table_dir or cache_dir()
        return ([] if args.no_save else [table.save(folder / table.key.filename)]) + (
            [table.save(args.out)] if args.out is not None else []
        )

    # Saved after every bucket too: a run stopped by a time limit keeps the buckets it finished.
    table = calibrate(
        model, args.batch_sizes, args.kv_lengths, args.nodes, epsilon=args.epsilon, verify=args.verify,
        topk=args.topk, depth=args.depth, warmup=args.warmup, reps=args.reps, max_ratio=args.max_ratio,
        prefill_chunk=args.prefill_chunk,
        seed=args.seed, cuda_graphs=args.cuda_graphs, compile=args.compile, attention=args.attention, on_bucket=save,
    )  # fmt: skip
    written = save(table)
    if not first:
        return 0
    key = table.key
    print(f"{key.model} on {key.device}, {key.dtype}, {key.verify}, {key.launch}, epsilon {table.epsilon}:")
    print(f"{'batch':>6} {'KV':>7} {'T_ver(floor)':>12} {'T_commit':>9} {'budget':>6}  N:T(N)/T(floor) (ms)")
    for e in table.entries:
        floor = e.t_floor + e.t_commit
        ratios = " ".join(f"{n}:{(t + e.t_commit) / floor:.2f}" for n, t in zip(e.nodes, e.t_ver))
        print(f"{e.batch_size:>6} {e.kv_length:>7} {e.t_floor:>12.2f} {e.t_commit:>9.2f} {e.budget:>6}  {ratios}")
    for path in written:
        print(f"wrote {path}")
    plot = args.plot or written[-1].with_suffix(".png")
    try:
        print(f"wrote {plot_table(table, plot)}")
    except ImportError as e:
        print(f"no plot: {e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
