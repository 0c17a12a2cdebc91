"""Variants of hf_bole's decoding swapped inside one process, their timed passes taken in turns.

Separate processes one after the other differed by 50% in host-bound phases (call 2 of the thirteenth session), so
a change of a few percent is measured inside one process, on the same model, graphs and cache. Takes eval/run.py's
arguments (the first batch size and dataset); per variant it prints the median tokens/s of `--repeats` passes and
the phases per round (`bole_profile`), and writes them to `<output-dir>/ab_<name>_<dataset>_b<B>[_compiled].jsonl`.

A variant is a function of the model that puts the variant in force (what it swaps, or nothing) and returns the
generate keyword arguments it adds:

    ab_turns.main("pipeline", {"pipelined": lambda model: {"bole_pipeline": True},
                               "serial": lambda model: {"bole_pipeline": False}})
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

import hf_bole
from eval import run
from eval.modes import make_modes

START = time.perf_counter()


def stage(what: str) -> None:
    print(f"[{time.perf_counter() - START:6.1f} s] {what}", flush=True)


def main(
    name: str, variants: dict[str, Callable[[object], dict]], argv: list[str] | None = None, profile: bool = True
) -> list[dict]:
    """Runs `variants` (name -> function of the model returning generate kwargs) in turns; returns one row each.
    With `profile=False` the passes run without the phase timer (its events and ranges are host work of their own,
    in rounds that may be bound by the host) and rows carry no phases."""
    args = run.parse_args(sys.argv[1:] if argv is None else argv)
    args.profile = profile
    cuda = torch.cuda.is_available()  # on a CPU: a check of the script
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    run.set_backends(args)
    torch.manual_seed(args.seed)
    model, tokenizer, label = run.load_target(args, device, torch.bfloat16 if cuda else torch.float32)
    stage("model loaded")
    dataset, prompts = next(iter(run.load_prompt_sets(args, model, tokenizer).items()))
    generation = run.generation_kwargs(args, model, tokenizer)
    B = args.batch_sizes[0]
    batch = list(range(min(B, len(prompts))))
    ar = next(iter(make_modes("ar", B, args)))
    reference = [run.run_batch(model, tokenizer, prompts, batch, ar, args, generation, [])]
    stage("ar reference")
    (mode,) = make_modes("bole", B, args)
    if cuda:
        hf_bole.warmup(model, len(batch), verify=mode.verify or "closed_form")
    results = {variant: [] for variant in variants}

    def one(variant: str) -> dict:
        kwargs = variants[variant](model)
        return run.run_batch(model, tokenizer, prompts, batch, mode, args, {**generation, **kwargs}, reference)

    stage("warmed up")
    for variant in variants:  # capture each variant's graphs (and compile), untimed
        one(variant)
    stage("graphs captured")
    for turn in range(args.repeats):
        order = list(variants) if turn % 2 == 0 else list(variants)[::-1]
        for variant in order:
            record = one(variant)
            exact = all(d is None for d in record["divergences"] or [None])
            n = sum(len(t) for t in record["tokens"])
            played = [a for a in record["accept_lengths"] if a > 0]
            results[variant].append({"tokens_per_s": n / record["seconds"], "exact": exact,
                                     "accepted": sum(played) / max(len(played), 1),
                                     **(record["round_time_ms"] or {})})  # fmt: skip
        stage(f"turn {turn}: " + ", ".join(f"{k} {v[-1]['tokens_per_s']:.1f}" for k, v in results.items()))
    gpu = torch.cuda.get_device_name(device) if cuda else "cpu"
    print(f"\n{label}, {dataset}, batch {B}, {args.max_new_tokens} new tokens, {gpu}")
    width = max(map(len, variants))
    rows = []
    for variant, passes in results.items():
        tps = [p["tokens_per_s"] for p in passes]
        rounds = sum(p.get("rounds", 0) for p in passes)  # phases: ms summed over a pass's rounds; here per round
        kept = [k for k in passes[0] if k not in ("tokens_per_s", "exact", "accepted", "rounds")]
        phases = {k: sum(p[k] for p in passes) / rounds for k in kept} if rounds else {}
        exact = all(p["exact"] for p in passes)
        accepted = statistics.mean(p["accepted"] for p in passes)  # tokens a round, mean over passes
        row = {"variant": variant, "batch_size": B, "median_tokens_per_s": statistics.median(tps), "passes": tps,
               "exact": exact, "accepted": accepted, "phase_ms": phases}  # fmt: skip
        rows.append(row)
        cells = " ".join(f"{k} {v:.3f}" for k, v in phases.items())
        print(f"{variant:{width}s} median {statistics.median(tps):8.1f} tok/s  min {min(tps):8.1f} "
              f"max {max(tps):8.1f}  exact {exact}  accepted {accepted:.2f}  {cells}  "
              + (f"phases {sum(phases.values()):.2f} ms" if phases else ""))  # fmt: skip
    out = Path(args.output_dir) / f"ab_{name}_{dataset}_b{B}{'_compiled' if args.compile[0] else ''}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows
