"""hf_bole's drafters side by side with transformers' own assisted decoding, batch 1, on one GPU:

    python eval/bench_drafters.py --out benchmarks/drafters_house_b1.jsonl

Modes, every prompt decoded by each in turn, `--repeats` passes (so that a GPU's drift shows in all of them):

    ar                plain greedy `generate` (the reference every output is compared with)
    bole-mtp          hf_bole with the checkpoint's MTP head (`bole_drafter="mtp"`)
    bole-ngram        hf_bole with prompt lookup grown into a tree (`bole_drafter="ngram"`)
    bole-small        hf_bole with the small model (`assistant_model=small`: `ModelDrafter`)
    hf-assisted       transformers' assisted decoding with the same small model (`assistant_model=small` without
                      hf_bole; transformers >= 5.25 runs it on stateful targets, earlier versions refuse them)
    hf-prompt-lookup  transformers' prompt lookup decoding (`prompt_lookup_num_tokens`, same version rule)

The small model (`--small-layers`, default 0 3) is the target cut to those decoder layers, with its embedding, final
norm and LM head: a GDN layer and a full-attention layer of the house model, untrained as a drafter (an early exit).
`--small PATH` takes a trained small checkpoint of the same tokenizer instead. Each output is compared with `ar`'s:
`exact` says whether every prompt's tokens were `ar`'s. One untimed call per mode and prompt comes first (CUDA graph
captures, torch.compile). Every line of the JSONL output records the machine (`eval.report.machine`) and the settings.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers
from packaging.version import Version
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hf_bole  # noqa: E402, F401  (registers custom_generate="hf_bole")
from eval.data import load_prompts  # noqa: E402
from eval.report import machine  # noqa: E402
from eval.shapes import HOUSE_CHECKPOINT  # noqa: E402

MODES = ("ar", "bole-mtp", "bole-ngram", "bole-small", "hf-assisted", "hf-prompt-lookup")
# transformers' assisted decoding of stateful models (GDN states rolled back from a recorded history)
HF_STATEFUL_ASSISTED = Version("5.25")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(HOUSE_CHECKPOINT), help="the target checkpoint (default: the house model)")
    ap.add_argument("--small", help="a small drafter checkpoint of the target's tokenizer (default: --small-layers)")
    ap.add_argument("--small-layers", type=int, nargs="+", default=[0, 3], help="the target's layers the small model keeps")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--dataset", default="mbpp")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--depth", type=int, default=6, help="bole_depth of the hf_bole modes")
    ap.add_argument("--topk", type=int, default=4, help="bole_topk of the hf_bole modes")
    ap.add_argument("--prompt-lookup", type=int, default=10, help="prompt_lookup_num_tokens of hf-prompt-lookup")
    ap.add_argument("--out", default="benchmarks/drafters_house_b1.jsonl")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return ap.parse_args(argv)


def cut(model, layers: list[int]):
    """A copy of `model` with only its decoder layers `layers` (in that order), sharing nothing with it."""
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = len(layers)
    config.layer_types = [model.config.layer_types[i] for i in layers]
    small = type(model)._from_config(config, dtype=model.dtype, attn_implementation="sdpa").to(model.device)
    state = {}
    for key, value in model.state_dict().items():
        if ".layers." not in key:
            state[key] = value
        else:
            head, rest = key.split(".layers.", 1)
            index, tail = rest.split(".", 1)
            if int(index) in layers:
                state[f"{head}.layers.{layers.index(int(index))}.{tail}"] = value
    small.load_state_dict(state)
    return small.eval()


def mode_kwargs(mode: str, small, args) -> dict:
    tree = dict(custom_generate="hf_bole", bole_depth=args.depth, bole_topk=args.topk)
    return {
        "ar": {},
        "bole-mtp": dict(tree, bole_drafter="mtp"),
        "bole-ngram": dict(tree, bole_drafter="ngram"),
        "bole-small": dict(tree, assistant_model=small),
        "hf-assisted": dict(assistant_model=small),
        "hf-prompt-lookup": dict(prompt_lookup_num_tokens=args.prompt_lookup),
    }[mode]


def timed(model, ids: torch.Tensor, kwargs: dict) -> tuple[torch.Tensor, float, float | None]:
    """One `generate` call: its new tokens `[T]`, wall seconds, and hf_bole's mean accepted tokens (None elsewhere)."""
    bole = kwargs.get("custom_generate") == "hf_bole"
    if ids.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    # dict outputs for the statistics, without a cache handed back (whose per-round cuts a plain call does not pay)
    out = model.generate(ids, **kwargs, **({"return_dict_in_generate": True, "use_cache": False} if bole else {}))
    if ids.is_cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    sequences = out.sequences if bole else out
    return sequences[0, ids.shape[1] :], seconds, out.mean_accepted_tokens if bole else None


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    if args.small:
        small = AutoModelForCausalLM.from_pretrained(args.small, dtype=dtype, attn_implementation="sdpa").to(device)
        small_label = args.small
    else:
        small = cut(model, args.small_layers)
        small_label = f"{Path(args.model).name} layers {args.small_layers}"
    modes = list(args.modes)
    if Version(transformers.__version__) < HF_STATEFUL_ASSISTED:
        skipped = [m for m in modes if m.startswith("hf-")]
        modes = [m for m in modes if not m.startswith("hf-")]
        if skipped:
            print(f"skipping {skipped}: transformers {transformers.__version__} refuses assisted decoding of stateful "
                  f"models (runs from {HF_STATEFUL_ASSISTED})")  # fmt: skip
    common = dict(max_new_tokens=args.max_new_tokens, do_sample=False, top_p=None, top_k=None, temperature=None,
                  pad_token_id=tokenizer.pad_token_id or 0, eos_token_id=model.generation_config.eos_token_id)  # fmt: skip
    prompts = load_prompts(args.dataset, args.num_prompts, tokenizer=tokenizer)
    inputs = [tokenizer(p.text, return_tensors="pt").input_ids.to(device) for p in prompts]
    kwargs = {mode: {**common, **mode_kwargs(mode, small, args)} for mode in modes}

    reference = [timed(model, ids, kwargs["ar"] if "ar" in kwargs else common)[0] for ids in inputs]
    for mode in modes:  # warm-up: graphs, compiles, first-call allocations
        for ids in inputs:
            timed(model, ids, kwargs[mode])
    rows: dict[str, list[dict]] = {mode: [] for mode in modes}
    for _ in range(args.repeats):
        passes = {mode: dict(tokens=0, seconds=0.0, accepted=[], exact=True) for mode in modes}
        for ids, ref in zip(inputs, reference):
            for mode in modes:  # each prompt by every mode in turn
                tokens, seconds, accepted = timed(model, ids, kwargs[mode])
                p = passes[mode]
                p["tokens"] += tokens.numel()
                p["seconds"] += seconds
                p["exact"] &= torch.equal(tokens, ref)
                if accepted is not None:
                    p["accepted"].append(accepted)
        for mode, p in passes.items():
            rows[mode].append(p)

    header = dict(machine=machine(), settings={**vars(args), "small": small_label, "modes": modes})
    base = statistics.median(p["tokens"] / p["seconds"] for p in rows["ar"]) if "ar" in rows else None
    records = []
    for mode, passes in rows.items():
        rates = [p["tokens"] / p["seconds"] for p in passes]
        rate = statistics.median(rates)
        accepted = [a for p in passes for a in p["accepted"]]
        records.append({
            **header, "mode": mode, "batch_size": 1, "tokens_per_s": rate, "tokens_per_s_all": rates,
            "speedup_over_ar": rate / base if base else None,
            "mean_accepted_tokens": statistics.mean(accepted) if accepted else None,
            "exact": all(p["exact"] for p in passes), "tokens": passes[0]["tokens"],
        })  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    print(f"| mode | tokens/s | over ar | accepted/round | exact |  ({header['machine']['gpu']}, batch 1, "
          f"{args.dataset} x {len(prompts)}, {args.max_new_tokens} new tokens, small: {small_label})")  # fmt: skip
    print("|---|---|---|---|---|")
    for r in records:
        over = f"{r['speedup_over_ar']:.2f}x" if r["speedup_over_ar"] else "-"
        acc = f"{r['mean_accepted_tokens']:.2f}" if r["mean_accepted_tokens"] else "-"
        print(f"| {r['mode']} | {r['tokens_per_s']:.1f} | {over} | {acc} | {r['exact']} |")
    print(f"wrote {out}")
    return records


if __name__ == "__main__":
    main()
