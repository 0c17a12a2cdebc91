"""Registers and spills of hf_bole's kernels for an H200 (sm_90a), compiled offline: no GPU needed.

Triton compiles each launch config to PTX for the target, and the ptxas that ships in Triton's wheel reports
registers, spill stores and spill loads per thread (`ptxas -v`). On an H200 both kernels ran at their register
limit (Nsight Compute), so spills are what a change to them should be checked for
before a GPU run. The figures come from this machine's Triton, which may differ from the GPU's. Usage:

    python eval/kernel_registers.py [--kernels gdn attention masks] [--tile 128] [--one-half] [--precision tf32x3]

gdn: the closed form's solve and apply kernels at every launch config; attention: the tree attention's split and
merge kernels at the tiles `_tiles` picks, one split and several, bf16 and fp32 (Qwen3.5's grouping, 4 query heads a
key head); masks: the round-mask kernel at every tree tile, with the masks and the ancestors alone; kv: the commit's KV move.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU target, not for the interpreter

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hf_bole.kernels import attention, kv_move  # noqa: E402
from hf_bole.kernels.tree_gdn import ancestors  # noqa: E402
from hf_bole.kernels.tree_gdn import closed_form_kernels as kernels  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
# Pointer and scalar types of the kernels' arguments as a model calls them (bf16 q/k/v/beta, fp32 g and state).
POINTERS = {"q": "*bf16", "k": "*bf16", "v": "*bf16", "beta": "*bf16", "g": "*fp32", "h0": "*fp32", "anc": "*i1",
            "o": "*bf16", "scale": "fp32", "out": "*bf16", "scale_log2": "fp32", "lengths": "*i64", "valid": "*u8",
            "ancestors": "*u8", "parents": "*i64", "positions": "*i64", "position_ids": "*i64",
            "attention_mask": "*u8", "keys": "*bf16", "values": "*bf16", "path": "*i64"}  # fmt: skip
SCALARS = ("B", "T", "H", "HK", "N", "C", "L", "extra", "limit")


def ptxas() -> str:
    """Triton's bundled ptxas that accepts the PTX version this Triton emits (the newest one shipped)."""
    folder = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    names = [n for n in ("ptxas-blackwell", "ptxas") if os.path.exists(os.path.join(folder, n))]
    if not names:
        raise SystemExit(f"no ptxas in {folder}: this Triton wheel does not ship one")
    return os.path.join(folder, names[0])


def signature(fn, constexprs: dict) -> dict:
    """Every argument of `fn` typed: constexprs as such, pointers by name (fp32 by default), the rest i32."""
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in POINTERS:
            sig[name] = POINTERS[name]
        elif name.startswith("stride") or name in SCALARS:
            sig[name] = "i32"
        else:
            sig[name] = "*fp32"
    return sig


def registers(fn, constexprs: dict, config: triton.Config, float_type: str = "bf16") -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) per thread of `fn` built with `constexprs` and `config`, its
    bf16 pointers of `float_type` instead."""
    constexprs = {**constexprs, **config.kwargs}
    typed = {n: t.replace("bf16", float_type) for n, t in signature(fn, constexprs).items()}
    source = ASTSource(fn=fn, signature=typed, constexprs=constexprs)
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    compiled = triton.compile(source, target=TARGET, options=options)
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        run = subprocess.run(
            [ptxas(), "-v", "--gpu-name", "sm_90a", ptx, "-o", os.path.join(tmp, "kernel.cubin")],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
    report = run.stdout + run.stderr
    used = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    return int(used.group(1)), int(spills.group(1)), int(spills.group(2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", nargs="+", choices=["gdn", "attention", "masks", "kv"], default=["gdn"])
    ap.add_argument("--tile", type=int, default=128, help="gdn: the tree tile BT (32, 64 or 128)")
    ap.add_argument("--one-half", action="store_true", help="gdn: a tree of one block, the tile's first half")
    ap.add_argument("--precision", default="tf32x3", help="gdn: dot_precision of the float32 matmuls")
    args = ap.parse_args()
    print(f"Triton {triton.__version__}, sm_90a")
    print(f"{'kernel':<7} {'config':<44} {'registers':>9} {'spill stores':>12} {'spill loads':>11}")
    for part in args.kernels:
        {"gdn": gdn_kernels, "attention": attention_kernels, "masks": mask_kernels, "kv": kv_kernels}[part](args)


def report(name: str, described: str, counts: tuple[int, int, int]) -> None:
    regs, stores, loads = counts
    print(f"{name:<7} {described:<44} {regs:>9} {stores:>12} {loads:>11}", flush=True)


def attention_kernels(args) -> None:
    for block_d in (256, 128, 64):
        block_m, block_n, warps = attention._tiles(block_d)
        for float_type, precision in (("bf16", "tf32"), ("fp32", "ieee")):
            for splits in (1, 6):
                constexprs = dict(
                    REP=4, HKV=4, D=block_d, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n, SPLIT=3 * block_n,
                    NUM_SPLITS=splits, DOT_PRECISION=precision, UPCAST_DOT=False,
                )  # fmt: skip
                config = triton.Config({}, num_warps=warps)
                counts = registers(attention.tree_attention_split_kernel, constexprs, config, float_type)
                report("split", f"D={block_d},{block_m}x{block_n},w={warps},{float_type},splits={splits}", counts)
            merge_m, chunk = attention._merge_tiles(4 * 32, block_d, 6)  # 4 query heads a key head, 32 nodes
            constexprs = dict(REP=4, HKV=4, D=block_d, BLOCK_D=block_d, BLOCK_M=merge_m, SPLIT=96,
                              NUM_SPLITS=6, CHUNK=chunk, HAS_LENGTHS=True)  # fmt: skip
            config = triton.Config({}, num_warps=4)
            counts = registers(attention.tree_attention_merge_kernel, constexprs, config, float_type)
            report("merge", f"D={block_d},{merge_m} rows,{chunk} splits,w=4,{float_type}", counts)


def mask_kernels(args) -> None:
    for bt in (16, 32, 64, 128):
        for masks in (True, False):
            constexprs = dict(BT=bt, LOG_BT=(bt - 1).bit_length(), BLOCK_C=ancestors.BLOCK_C, MASKS=masks)
            config = triton.Config({}, num_warps=4 if bt <= 64 else 8)
            counts = registers(ancestors.tree_masks_fwd_kernel, constexprs, config)
            report("masks", f"BT={bt},masks={masks},w={config.num_warps}", counts)


def kv_kernels(args) -> None:
    for block_l in (2, 8, 16):
        constexprs = dict(H=4, D=256, DV=256, BLOCK_L=block_l, BLOCK_D=256, BLOCK_DV=256)
        counts = registers(kv_move.kv_commit_fwd_kernel, constexprs, triton.Config({}, num_warps=4))
        report("kv", f"L<={block_l},D=256,w=4", counts)


def gdn_kernels(args) -> None:
    common = {"K": 128, "BT": args.tile, "ONE_HALF": args.one_half, "USE_QK_L2NORM": True,
              "DOT_PRECISION": args.precision, "UPCAST_DOT": False, "USE_PDL": True}  # fmt: skip
    apply = {**common, "V": 128, "USE_INITIAL_STATE": True, "SPLIT_STATE": True}
    print(f"gdn: K = V = 128, BT = {args.tile}{' (one block)' * args.one_half}, {args.precision}")
    for name, fn, constexprs, configs in (
        ("solve", kernels.tree_gdn_verify_solve_kernel.fn, common, kernels.SOLVE_CONFIGS),
        ("apply", kernels.tree_gdn_verify_apply_kernel.fn.fn, apply, kernels.APPLY_CONFIGS),
    ):
        for config in configs:
            described = ",".join(f"{k}={v}" for k, v in config.kwargs.items()) + f",w={config.num_warps}"
            report(name, described, registers(fn, constexprs, config))


if __name__ == "__main__":
    main()
