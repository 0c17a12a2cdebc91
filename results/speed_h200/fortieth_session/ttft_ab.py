"""The fortieth session's two first-token changes against their forms before, in one process, passes in turns: batch
1, house model, each prompt its own call.

    now      the library as it is: a prompt's drafter extension in chunks of 128 entries replayed from a graph
             (`MTPDrafter._extend_replayed`), the prefill chains' inputs built at once; with `commit_graphs.patch`
             applied, also the chains' commits replayed (`graphs.CommitGraphs`)
    before   the extension eager, each chain's inputs built and committed from Python (`chain_prefill` as of f9bcacc,
             copied below)

For chain d10 and bole d10 (31 nodes): tokens/s, TTFT, ms a token in the decode ((wall - TTFT) / tokens after the
first), the median pass of each; and whether each call's tokens equal `ar`'s.

    python results/speed_h200/fortieth_session/ttft_ab.py --datasets mbpp --num-prompts 8 --max-new-tokens 128 \
        --repeats 6 --out ab.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import hf_bole  # noqa: E402
from eval import run  # noqa: E402
from eval.modes import Mode, make_modes  # noqa: E402
from hf_bole.generation import loop  # noqa: E402
from hf_bole.generation.drafters.mtp import MTPDrafter  # noqa: E402
from hf_bole.generation.graphs import width_bucket  # noqa: E402
from hf_bole.kernels.tree_gdn.closed_form import MAX_NODES  # noqa: E402

NOW = {"extend": MTPDrafter._extend_replayed, "prefill": loop.chain_prefill}


@torch.no_grad()
def chain_prefill_before(verify_forward, cache, input_ids, mask, pad_token, commit=None):
    """`chain_prefill` as of f9bcacc: each chain's inputs built, and the chain committed, from Python."""
    B, P = input_ids.shape
    device = input_ids.device
    lengths = mask.sum(-1)
    left_pad = P - lengths
    longest = int(lengths.max())
    hidden = None
    for start in range(0, longest, MAX_NODES):
        width = width_bucket(min(MAX_NODES, longest - start), MAX_NODES)
        index = start + torch.arange(width, device=device)
        real = index[None] < lengths[:, None]
        columns = torch.where(real, left_pad[:, None] + index[None], P)
        ids = torch.where(real, input_ids.gather(1, columns.clamp(max=P - 1)), pad_token)
        parents = torch.where(real, index[None] - start - 1, -1)
        out = verify_forward(ids, parents.to(cache.device))
        if hidden is None:
            hidden = out.hidden_states.new_zeros(B, P + 1, out.hidden_states.shape[-1])
        hidden.scatter_(1, columns.to(hidden.device)[..., None].expand(-1, -1, hidden.shape[-1]), out.hidden_states)
        path = torch.where(real, index[None] - start, -1)
        cache.commit(path.to(cache.device), check_values=False)
    return hidden[:, :P]


def use(variant: str) -> None:
    if variant == "before":
        MTPDrafter._extend_replayed = MTPDrafter._extend  # the whole extension at once, eagerly
        loop.chain_prefill = chain_prefill_before
    else:
        MTPDrafter._extend_replayed = NOW["extend"]
        loop.chain_prefill = NOW["prefill"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ours, rest = ap.parse_known_args()
    args = run.parse_args(rest + ["--batch-sizes", "1"])
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    run.set_backends(args)
    torch.manual_seed(args.seed)
    model, tokenizer, label = run.load_target(args, device, torch.bfloat16 if cuda else torch.float32)
    dataset, prompts = next(iter(run.load_prompt_sets(args, model, tokenizer).items()))
    generation = run.generation_kwargs(args, model, tokenizer)
    batches = [[i] for i in range(len(prompts))]
    (ar,) = make_modes("ar", 1, args)
    reference = [run.run_batch(model, tokenizer, prompts, b, ar, args, generation, []) for b in batches]
    modes = {
        "chain d10": Mode("chain", 10, 1, 10, 0.3, "closed_form", label="chain d10"),
        "bole d10 b31": Mode("bole", 10, 4, 31, 0.3, "closed_form", label="bole d10 b31"),
    }
    variants = [(m, v) for m in modes for v in ("before", "now")]
    if cuda:
        hf_bole.warmup(model, 1, verify="closed_form")

    def timed_pass(mode: str, variant: str) -> dict:
        use(variant)
        calls = [run.run_batch(model, tokenizer, prompts, b, modes[mode], args, generation, [r])
                 for b, r in zip(batches, reference)]  # fmt: skip
        tokens = sum(len(c["tokens"][0]) for c in calls)
        decode = sum(c["seconds"] - c["ttft"] for c in calls)
        return {
            "tokens_per_s": tokens / sum(c["seconds"] for c in calls),
            "ttft_ms": 1e3 * statistics.mean(c["ttft"] for c in calls),
            "decode_ms_per_token": 1e3 * decode / (tokens - len(calls)),
            "equal_to_ar": sum(all(d is None for d in c["divergences"] or [None]) for c in calls),
            "tokens": [c["tokens"][0] for c in calls],
        }

    start = time.perf_counter()
    for m, v in variants:  # compiles and captures, untimed
        timed_pass(m, v)
        print(f"[{time.perf_counter() - start:6.1f} s] {m} {v}: first pass", flush=True)
    passes = {f"{m} {v}": [] for m, v in variants}
    for turn in range(args.repeats):
        for m, v in variants if turn % 2 == 0 else variants[::-1]:
            passes[f"{m} {v}"].append(timed_pass(m, v))
        print(f"[{time.perf_counter() - start:6.1f} s] turn {turn}: " + ", ".join(
            f"{k} {p[-1]['tokens_per_s']:.0f}" for k, p in passes.items()), flush=True)  # fmt: skip
    rows = []
    for name, runs in passes.items():
        rows.append({"variant": name, **{k: statistics.median(p[k] for p in runs)
                                         for k in ("tokens_per_s", "ttft_ms", "decode_ms_per_token")},
                     "equal_to_ar": min(p["equal_to_ar"] for p in runs), "passes": runs})  # fmt: skip
    same = {m: all(a == b for pb, pn in zip(passes[f"{m} before"], passes[f"{m} now"])
                   for a, b in zip(pb["tokens"], pn["tokens"])) for m in modes}  # fmt: skip
    Path(ours.out).write_text(json.dumps({"model": label, "dataset": dataset, "rows": rows, "same_tokens": same,
                                          "gpu": torch.cuda.get_device_name(device) if cuda else "cpu",
                                          "torch": torch.__version__}, indent=1))  # fmt: skip
    print(f"\n{label}, {dataset}, batch 1, {len(batches)} prompts, {args.max_new_tokens} new tokens, "
          f"median of {args.repeats} passes")
    print("| variant | tokens/s | TTFT ms | decode ms a token | prompts equal to ar (worst pass) |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['variant']} | {r['tokens_per_s']:.1f} | {r['ttft_ms']:.2f} | {r['decode_ms_per_token']:.4f} | "
              f"{r['equal_to_ar']}/{len(batches)} |")
    print(f"same tokens before and now, every pass: {same}")


if __name__ == "__main__":
    main()
