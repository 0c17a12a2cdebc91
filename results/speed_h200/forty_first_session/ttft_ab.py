"""The host-time changes of the fortieth and forty-first sessions against their forms before, in one process,
passes in turns: batch 1, house model, each prompt its own call.

    before          the drafter's extension by the prompt eager, each prefill chain's inputs built and committed from
                    Python (`chain_prefill` as of f9bcacc: `../fortieth_session/ttft_ab.py`), the token writes and
                    their graphs made anew in every call
    now             the library as it is
    now, writes per call
                    only with `kept_writes.patch` applied: the token writes (`loop._Writes`) made anew in every call, as before: an eager write and a
                    capture per width a call
    now, eager commits
                    only where the library replays the prefill chains' commits from graphs (`graphs.CommitGraphs`,
                    `../fortieth_session/commit_graphs.patch` applied): the same with each chain's commit launched from
                    Python

For chain d10 and bole d10 (31 nodes): tokens/s, TTFT, ms a token in the decode ((wall - TTFT) / tokens after the
first), the median pass of each; whether each call's tokens equal `ar`'s, and whether every variant's tokens equal
the first's.

    python results/speed_h200/forty_first_session/ttft_ab.py --datasets mbpp --num-prompts 8 --max-new-tokens 128 \
        --repeats 6 --out ab.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

import hf_bole  # noqa: E402
from eval import run  # noqa: E402
from eval.modes import Mode, make_modes  # noqa: E402
from hf_bole.generation import graphs, loop  # noqa: E402
from hf_bole.generation.drafters.mtp import MTPDrafter  # noqa: E402

_spec = importlib.util.spec_from_file_location("fortieth_ab", ROOT / "results/speed_h200/fortieth_session/ttft_ab.py")
fortieth = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fortieth)

NOW = {"extend": MTPDrafter._extend_replayed, "prefill": loop.chain_prefill}
COMMIT_GRAPHS = hasattr(graphs, "CommitGraphs")
KEPT_WRITES = hasattr(loop, "_WRITES")  # kept_writes.patch applied


def eager_commits(verify_forward, cache, input_ids, mask, pad_token, commit=None):
    return NOW["prefill"](verify_forward, cache, input_ids, mask, pad_token)


def use(variant: str) -> None:
    MTPDrafter._extend_replayed = MTPDrafter._extend if variant == "before" else NOW["extend"]
    prefill = {"before": fortieth.chain_prefill_before, "now, eager commits": eager_commits}
    loop.chain_prefill = prefill.get(variant, NOW["prefill"])


def call(variant: str, *args) -> dict:
    if KEPT_WRITES and variant in ("before", "now, writes per call"):
        loop._WRITES.clear()  # no writes kept from the call before
    return run.run_batch(*args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", nargs="+", choices=("chain", "bole"), help="the modes timed (default: both)")
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
    modes = {k: m for k, m in modes.items() if ours.only is None or m.name in ours.only}
    names = ["before", "now"] + (["now, writes per call"] if KEPT_WRITES else [])
    names += ["now, eager commits"] if COMMIT_GRAPHS else []
    variants = [(m, v) for m in modes for v in names]
    print(f"commit graphs in the library: {COMMIT_GRAPHS}", flush=True)
    if cuda:
        hf_bole.warmup(model, 1, verify="closed_form")

    def timed_pass(mode: str, variant: str) -> dict:
        use(variant)
        calls = [call(variant, model, tokenizer, prompts, b, modes[mode], args, generation, [r])
                 for b, r in zip(batches, reference)]  # fmt: skip
        tokens = sum(len(c["tokens"][0]) for c in calls)
        decode = sum(c["seconds"] - c["ttft"] for c in calls)
        return {
            "tokens_per_s": tokens / sum(c["seconds"] for c in calls),
            "ttft_ms": 1e3 * statistics.median(c["ttft"] for c in calls),
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
    same = {m: all(p["tokens"] == passes[f"{m} {names[0]}"][0]["tokens"] for v in names for p in passes[f"{m} {v}"])
            for m in modes}  # fmt: skip
    Path(ours.out).write_text(json.dumps({"model": label, "dataset": dataset, "rows": rows, "same_tokens": same,
                                          "commit_graphs": COMMIT_GRAPHS,
                                          "gpu": torch.cuda.get_device_name(device) if cuda else "cpu",
                                          "torch": torch.__version__}, indent=1))  # fmt: skip
    print(f"\n{label}, {dataset}, batch 1, {len(batches)} prompts, {args.max_new_tokens} new tokens, "
          f"median of {args.repeats} passes (TTFT: median call of a pass)")
    print("| variant | tokens/s | TTFT ms | decode ms a token | prompts equal to ar (worst pass) |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['variant']} | {r['tokens_per_s']:.1f} | {r['ttft_ms']:.2f} | {r['decode_ms_per_token']:.4f} | "
              f"{r['equal_to_ar']}/{len(batches)} |")
    print(f"same tokens in every variant and pass: {same}")


if __name__ == "__main__":
    main()
