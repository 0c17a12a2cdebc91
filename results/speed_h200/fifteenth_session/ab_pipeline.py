"""Pipelined rounds (`bole_pipeline=True`, the default) against rounds one after the other (`False`), in one process,
passes taken in turns.

Separate processes one after the other differed by 50% in host-bound phases (call 2 of the thirteenth session), so
this script runs both variants inside one process on the same graphs and cache; only `bole_pipeline` differs. Takes
eval/run.py's arguments (the first batch size and dataset); per variant it prints the median tokens/s of `--repeats`
passes and the phases per round.

    python results/speed_h200/fifteenth_session/ab_pipeline.py --shape 9B --depth 6 --max-new-tokens 128 \
        --batch-sizes 1 --num-prompts 2 --repeats 7
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import hf_bole  # noqa: E402
from eval import run  # noqa: E402
from eval.modes import make_modes  # noqa: E402


START = time.perf_counter()


def stage(what: str) -> None:
    print(f"[{time.perf_counter() - START:6.1f} s] {what}", flush=True)


def main() -> None:
    args = run.parse_args(sys.argv[1:])
    args.profile = True
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
    variants = {"pipelined": True, "serial": False}
    results = {name: [] for name in variants}

    def one(name: str) -> dict:
        return run.run_batch(model, tokenizer, prompts, batch, mode, args, {**generation, "bole_pipeline": variants[name]}, reference)

    stage("warmed up")
    for name in variants:  # capture the graphs (and compile), untimed
        one(name)
    stage("graphs captured")
    for turn in range(args.repeats):
        order = list(variants) if turn % 2 == 0 else list(variants)[::-1]
        for name in order:
            record = one(name)
            exact = all(d is None for d in record["divergences"] or [None])
            n = sum(len(t) for t in record["tokens"])
            results[name].append({"tokens_per_s": n / record["seconds"], "exact": exact, **record["round_time_ms"]})
        stage(f"turn {turn}: " + ", ".join(f"{k} {v[-1]['tokens_per_s']:.1f}" for k, v in results.items()))
    gpu = torch.cuda.get_device_name(device) if cuda else "cpu"
    print(f"\n{label}, {dataset}, batch {B}, {args.max_new_tokens} new tokens, {gpu}")
    rows = []
    for name, passes in results.items():
        tps = [p["tokens_per_s"] for p in passes]
        rounds = sum(p["rounds"] for p in passes)  # phases: ms summed over a pass's rounds; here per round
        kept = [k for k in passes[0] if k not in ("tokens_per_s", "exact", "rounds")]
        phases = {k: sum(p[k] for p in passes) / rounds for k in kept}
        exact = all(p["exact"] for p in passes)
        row = {"variant": name, "batch_size": B, "median_tokens_per_s": statistics.median(tps), "passes": tps,
               "exact": exact, "phase_ms": phases}  # fmt: skip
        rows.append(row)
        cells = " ".join(f"{k} {v:.3f}" for k, v in phases.items())
        print(f"{name:9s} median {statistics.median(tps):8.1f} tok/s  min {min(tps):8.1f} max {max(tps):8.1f}  "
              f"exact {exact}  {cells}  phases {sum(phases.values()):.2f} ms")  # fmt: skip
    out = Path(args.output_dir) / f"ab_pipeline_{dataset}_b{B}{'_compiled' if args.compile[0] else ''}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
