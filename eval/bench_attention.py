"""A verify forward's tree attention and round masks on the GPU, side by side in one run, per full-attention layer:

  sdpa     what a tree forward runs with `bole_attention="model"`: transformers' SDPA path (`repeat_kv` of the
           storage to every query head, then `scaled_dot_product_attention` with the boolean [B, 1, N, C] mask;
           SDPA's backends as hf_bole's generate sets them, cuDNN off)
  triton   `hf_bole.kernels.tree_attention` (`bole_attention="triton"`): grouped heads, keys split over programs,
           the mask computed in the kernel, slots above lengths + N not read
and, once per round, the masks before the forward:
  masks-torch   `tree_masks_torch` (ancestors by repeated squaring, positions, the attention mask)
  masks-triton  `tree_masks` (one launch)

Shapes: Qwen3.5-9B's attention (16 query heads, 4 KV heads, head dim 256) and 27B's (24, 4, 256); each row's
committed length is `--fill` of the capacity, with random trees. Every op is timed as CUDA-graph replays over 4 input
sets (distinct storages), median of 30; outputs are checked against float64 first. Writes JSON lines, prints a table.

    python eval/bench_attention.py --out runs/attention.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eval.bench_kernels import machine_header, time_graph  # noqa: E402
from hf_bole.kernels import tree_attention, tree_masks  # noqa: E402
from hf_bole.kernels.attention import naive_tree_attention  # noqa: E402
from hf_bole.kernels.tree_gdn.ancestors import tree_attention_mask, tree_masks_torch  # noqa: E402
from hf_bole.models.adapter import attention_backends  # noqa: E402
from tests.kernels.trees import make_parents  # noqa: E402

SHAPES = {"9B": (16, 4, 256), "27B": (24, 4, 256)}  # query heads, KV heads, head dim


def sdpa_tree(q, k, v, mask, scale):
    """transformers' sdpa_attention_forward on a tree: KV repeated to the query heads, the boolean mask."""
    rep = q.shape[1] // k.shape[1]
    k, v = (x[:, :, None].expand(-1, -1, rep, -1, -1).flatten(1, 2) for x in (k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(1, 2).contiguous()


def inputs(B, H, Hkv, D, N, C, fill, seed):
    gen = torch.Generator().manual_seed(seed)
    parents = make_parents("mixed", N, B, seed=seed).cuda()
    lengths = torch.full((B,), int(fill * (C - N)), dtype=torch.int64).cuda()
    valid = torch.ones(B, C, dtype=torch.bool, device="cuda")
    q = torch.randn(B, N, H, D, generator=gen).to("cuda", torch.bfloat16).transpose(1, 2)  # transformers' view
    k, v = (torch.randn(B, Hkv, C, D, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    positions = lengths.clone()
    return q, k, v, lengths, valid, parents, positions


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", nargs="*", default=["9B"], choices=list(SHAPES))
    ap.add_argument("--batch-sizes", nargs="*", type=int, default=[1, 8, 16])
    ap.add_argument("--nodes", nargs="*", type=int, default=[16, 32, 64])
    ap.add_argument("--capacities", nargs="*", type=int, default=[512, 2048, 8192])
    ap.add_argument("--fill", type=float, default=0.5, help="committed share of the capacity")
    args = ap.parse_args(argv)
    header = machine_header()
    print(json.dumps(header))
    rows = []
    with attention_backends(), open(args.out, "w") as f:
        f.write(json.dumps({"header": header, "fill": args.fill}) + "\n")
        for shape in args.shapes:
            H, Hkv, D = SHAPES[shape]
            for B in args.batch_sizes:
                for N in args.nodes:
                    for C in args.capacities:
                        sets = [inputs(B, H, Hkv, D, N, C, args.fill, seed) for seed in range(4)]
                        q, k, v, lengths, valid, parents, positions = sets[0]
                        masks = tree_masks(parents, lengths, positions, valid)
                        anc, _, mask = masks
                        gold = naive_tree_attention(
                            *(x.double() for x in (q, k, v)), lengths, valid, anc, D**-0.5
                        ).float()
                        got = tree_attention(q, k, v, lengths, valid, anc).float()
                        ref = sdpa_tree(q, k, v, mask, D**-0.5).float()
                        err = {n: ((x - gold).norm() / gold.norm()).item() for n, x in (("triton", got), ("sdpa", ref))}
                        reference = tree_masks_torch(parents, lengths, positions, valid)
                        masks_ok = all(torch.equal(a, b) for a, b in zip(masks, reference))
                        assert torch.equal(mask[:, 0], tree_attention_mask(lengths, valid, anc)) and masks_ok
                        mask_sets = [(p, L, pos, val) for _, _, _, L, val, p, pos in sets]
                        full = [
                            (q, k, v, *tree_masks(*m)[::2], m[1], m[3]) for (q, k, v, *_), m in zip(sets, mask_sets)
                        ]
                        ms = {
                            "sdpa": time_graph(lambda q, k, v, a, m, L, val: sdpa_tree(q, k, v, m, D**-0.5), full),
                            "triton": time_graph(
                                lambda q, k, v, a, m, L, val: tree_attention(q, k, v, L, val, a), full
                            ),
                            "masks-torch": time_graph(tree_masks_torch, mask_sets),
                            "masks-triton": time_graph(tree_masks, mask_sets),
                        }
                        row = {"shape": shape, "B": B, "N": N, "C": C, "committed": int(lengths[0]),
                               "ms": {n: t[0] for n, t in ms.items()}, "rel_err": err}  # fmt: skip
                        rows.append(row)
                        f.write(json.dumps(row) + "\n")
                        f.flush()
                        print(row, flush=True)
    print(
        "\n| shape | B | N | C | sdpa µs | triton µs | × | masks torch µs | masks triton µs | err sdpa | err triton |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        t = r["ms"]
        print(f"| {r['shape']} | {r['B']} | {r['N']} | {r['C']} | {1e3 * t['sdpa']:.1f} | {1e3 * t['triton']:.1f} | "
              f"{t['sdpa'] / t['triton']:.2f} | {1e3 * t['masks-torch']:.1f} | {1e3 * t['masks-triton']:.1f} | "
              f"{r['rel_err']['sdpa']:.1e} | {r['rel_err']['triton']:.1e} |")  # fmt: skip


if __name__ == "__main__":
    main()
