"""What the MTP drafting graph runs at batch 1, kernel by kernel: house model, one MBPP prompt, 128 new tokens, depth
10, chain (topk 1, 10 nodes) and bole (topk 4, the table's budget), CUDA graphs, the drafter compiled.

The phase timer (gpu.sh prof1) put drafting at 1.33 ms (chain) and 1.50 ms (bole) of a 2.1-2.4 ms round on the
device timeline. This says what the drafting graph's part of them is made of: the graph alone, replayed `--replays`
times under the torch profiler: kernels a replay, their summed time and the replay's span, and the kernels that take
the most time, grouped by name. (The run at 3bab571 also listed a whole generate call's launches; that trace held no
kernel of the drafting graph's replays, so the listing is gone.)

    python results/speed_h200/thirty_seventh_session/draft_kernels.py --out $OUT
"""

import argparse
import collections
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from eval import run
from hf_bole.generation.drafters.mtp import MTPDrafter

DRAFTERS: list[MTPDrafter] = []


def remember(fn):
    def wrapper(self, *args, **kwargs):
        if self not in DRAFTERS:
            DRAFTERS.append(self)
        return fn(self, *args, **kwargs)

    return wrapper


def trace_events(prof, path: Path) -> list[dict]:
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    path.unlink()
    return events


def gpu_events(events: list[dict]) -> list[dict]:
    return sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e),
                  key=lambda e: e["ts"])  # fmt: skip


def short(name: str) -> str:
    return name if len(name) <= 70 else name[:67] + "..."


def draft_replays(drafter: MTPDrafter, replays: int, out: Path, label: str) -> dict:
    (key, graphed), *_ = sorted(drafter._graphs.items(), key=lambda kv: -kv[0][2])  # the widest tree's graph
    for _ in range(5):
        graphed.graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graphed.graph.replay()
            torch.cuda.synchronize()
    kernels = gpu_events(trace_events(prof, out / f"draft_{label}.json"))
    per_launch = collections.defaultdict(list)
    for e in kernels:
        per_launch[e["args"].get("correlation")].append(e)
    launches = [v for v in per_launch.values() if len(v) > 1]
    counts = [len(v) for v in launches]
    busy = [sum(e["dur"] for e in v) for v in launches]
    span = [v[-1]["ts"] + v[-1]["dur"] - v[0]["ts"] for v in launches]
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for v in launches:
        for e in v:
            by_name[e["name"]][0] += 1
            by_name[e["name"]][1] += e["dur"]
    n = max(len(launches), 1)
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:25]
    row = {"label": label, "graph_key": list(key), "kernels": statistics.median(counts),
           "busy_us": statistics.median(busy), "span_us": statistics.median(span), "levels": drafter.depth,
           "top": [{"name": k, "per_replay": c / n, "us": t / n} for k, (c, t) in top]}  # fmt: skip
    print(f"\n==== {label}: drafting graph (batch, new entries, nodes) = {key}, {len(launches)} replays: "
          f"{row['kernels']:.0f} kernels, {row['busy_us']:.0f} us of kernels, span {row['span_us']:.0f} us "
          f"({row['span_us'] / drafter.depth:.0f} us per MTP forward: the extension and {drafter.depth - 1} levels)")
    print(f"  {'kernel':70} {'a replay':>9} {'us a replay':>12}")
    for t in row["top"]:
        print(f"  {short(t['name']):70} {t['per_replay']:9.1f} {t['us']:12.1f}")
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--depth", type=int, default=10)
    ap.add_argument("--out", default="/tmp/draft_kernels")
    ours = ap.parse_args()
    out = Path(ours.out)
    out.mkdir(parents=True, exist_ok=True)
    args = run.parse_args(["--datasets", "mbpp", "--num-prompts", "8", "--max-new-tokens", "128"])
    device = torch.device("cuda")
    model, tokenizer, _ = run.load_target(args, device, torch.bfloat16)
    prompts = run.load_prompt_sets(args, model, tokenizer)["mbpp"]
    generation = run.generation_kwargs(args, model, tokenizer)
    ids = torch.tensor([prompts[0][1]], device=device)
    MTPDrafter.propose = remember(MTPDrafter.propose)
    summary = {}
    for label, topk, budget in (("chain", 1, ours.depth), ("bole", 4, "auto")):
        DRAFTERS.clear()
        kwargs = {"custom_generate": "hf_bole", "bole_depth": ours.depth, "bole_topk": topk, "bole_budget": budget,
                  "bole_verify": "closed_form", "return_dict_in_generate": True, **generation}
        for _ in range(3):
            model.generate(ids, **kwargs)
        torch.cuda.synchronize()
        row = draft_replays(DRAFTERS[0], ours.replays, out, label)
        summary[label] = row
    (out / "draft_kernels.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
