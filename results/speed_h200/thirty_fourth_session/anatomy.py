"""Where a whole generate call's time goes, not only its rounds': house model, MBPP, 8 prompts at batch 8, 128 new
tokens, bole and tree-serial at the tables' budgets, CUDA graphs, no phase timer, each warmed up first.

1. Host stamps over `--calls` calls (no profiler): transformers' preparation before hf_bole's `_decode`, hf_bole's
   set-up and prefill up to the first round's drafting, the rounds, and what follows them.
2. The torch profiler over two calls: the GPU's busy time (union of kernels and copies) against the call's span, the
   idle gaps over 20 us and the host's waits (stream, event and device synchronisations, blocking copies). The traces
   go to $OUT/trace_<verify>.json.gz.

    python results/speed_h200/thirty_fourth_session/anatomy.py --calls 10 --out $OUT
"""

import argparse
import gzip
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from eval import run  # noqa: E402
from hf_bole.generation import loop  # noqa: E402
from hf_bole.generation.drafters.mtp import MTPDrafter  # noqa: E402

STAMPS: dict[str, float] = {}


def stamped(name, fn):
    def wrapper(*args, **kwargs):
        STAMPS.setdefault(name, time.perf_counter())
        out = fn(*args, **kwargs)
        STAMPS[name + "_end"] = time.perf_counter()
        return out

    return wrapper


def gpu_intervals(events):
    spans = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                   if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e)  # fmt: skip
    merged, gaps = [], []
    for start, end, name in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
            merged[-1][3] = name
        else:
            if merged:
                gaps.append((start - merged[-1][1], merged[-1][3], name))
            merged.append([start, end, name, name])
    return merged, gaps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--out", default="/tmp/anatomy")
    ours = ap.parse_args()
    out_dir = Path(ours.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    args = run.parse_args(["--datasets", "mbpp", "--num-prompts", "8", "--max-new-tokens", "128", "--depth", "6"])
    device = torch.device("cuda")
    model, tokenizer, _ = run.load_target(args, device, torch.bfloat16)
    prompts = run.load_prompt_sets(args, model, tokenizer)["mbpp"]
    generation = run.generation_kwargs(args, model, tokenizer)
    rows = [p[1] for p in prompts]
    P, pad = max(map(len, rows)), generation["pad_token_id"]
    ids = torch.tensor([[pad] * (P - len(r)) + r for r in rows], device=device)
    mask = torch.tensor([[0] * (P - len(r)) + [1] * len(r) for r in rows], device=device)
    stops = tuple(dict.fromkeys(s for p, _ in prompts for s in p.stop))
    extra = dict(stopping_criteria=run.StoppingCriteriaList([run._stop_criterion(tokenizer, stops)])) if stops else {}
    loop._decode = stamped("decode", loop._decode)
    MTPDrafter.propose = stamped("propose", MTPDrafter.propose)
    summary = {}
    for verify in ("closed_form", "serial"):
        kwargs = dict(attention_mask=mask, custom_generate="hf_bole", bole_depth=6, bole_topk=4, bole_verify=verify,
                      return_dict_in_generate=True, **extra, **generation)  # fmt: skip
        for _ in range(3):
            model.generate(ids, **kwargs)
        torch.cuda.synchronize()
        parts = {k: [] for k in ("prep", "setup", "rounds", "after", "call", "n_rounds")}
        for _ in range(ours.calls):
            STAMPS.clear()
            start = time.perf_counter()
            out = model.generate(ids, **kwargs)
            torch.cuda.synchronize()
            end = time.perf_counter()
            parts["prep"].append(STAMPS["decode"] - start)
            parts["setup"].append(STAMPS["propose"] - STAMPS["decode"])
            parts["rounds"].append(STAMPS["decode_end"] - STAMPS["propose"])
            parts["after"].append(end - STAMPS["decode_end"])
            parts["call"].append(end - start)
            parts["n_rounds"].append(out.accept_lengths.shape[1])
        row = {k: statistics.median(v) * (1 if k == "n_rounds" else 1e3) for k, v in parts.items()}
        print(f"\n==== {verify}: median of {ours.calls} calls, ms: transformers' preparation {row['prep']:.2f}, "
              f"set-up and prefill to the first drafting {row['setup']:.2f}, rounds {row['rounds']:.2f} "
              f"({row['n_rounds']:.0f} rounds, {row['rounds'] / row['n_rounds']:.3f} a round), "
              f"after {row['after']:.2f}, call {row['call']:.2f}")  # fmt: skip
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(2):
                model.generate(ids, **kwargs)
            torch.cuda.synchronize()
        trace = out_dir / f"trace_{verify}.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
        with gzip.open(str(trace) + ".gz", "wt") as f:
            json.dump(events, f)
        trace.unlink()
        merged, gaps = gpu_intervals(events)
        span = merged[-1][1] - merged[0][0]
        busy = sum(e - s for s, e, *_ in merged)
        big = [g for g in gaps if g[0] > 20]
        waits = {}
        for e in events:
            if e.get("cat") == "cuda_runtime" and any(w in e["name"] for w in ("ynchronize", "Memcpy")):
                waits.setdefault(e["name"], []).append(e.get("dur", 0))
        row.update(gpu_span_ms=span / 2e3, gpu_busy_ms=busy / 2e3, idle_gaps_over_20us=len(big) / 2,
                   idle_in_them_ms=sum(g[0] for g in big) / 2e3)  # fmt: skip
        print(f"two calls under the profiler, per call: GPU span {span / 2e3:.2f} ms, busy {busy / 2e3:.2f} ms, "
              f"{len(big) / 2:.0f} idle gaps over 20 us holding {sum(g[0] for g in big) / 2e3:.2f} ms")  # fmt: skip
        for name, durs in sorted(waits.items(), key=lambda kv: -sum(kv[1])):
            print(f"  host {name}: {len(durs) / 2:.0f} a call, {sum(durs) / 2e3:.3f} ms a call, "
                  f"longest {max(durs):.0f} us")
        print("  longest idle gaps (us, kernel before -> kernel after):")
        for gap, before, after in sorted(big, reverse=True)[:12]:
            print(f"    {gap:8.0f}  {before[:60]} -> {after[:60]}")
        summary[verify] = row
    (out_dir / "anatomy.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
