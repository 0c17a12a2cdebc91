"""The first token at batch 1 on the house model, on the GPU's timeline, and the drafting graph kernel by kernel.

The thirty-ninth session found the host's first wait for the GPU at 0.01 ms: either the host is slower than the GPU
all the way to the first token, or something on the way synchronises and absorbs the prefill's GPU time. For chain
d10 and bole d10 (31 nodes), after two warm passes over the 8 MBPP prompts:

1. sync debug: each prompt once under `torch.cuda.set_sync_debug_mode("warn")`; every synchronising op, counted by
   its stack (hf_bole's and transformers' frames), before and after the first token;
2. profile: each prompt once under the profiler (CPU and CUDA), with markers at the call's start, the loop's start,
   the prefill's start and end, `_Rows` (the first token's bookkeeping), the drafter's first call and the first
   token. Per segment between markers: the host's time, the GPU kernels' time launched in it, and the GPU's busy
   time inside it; and every runtime call over 50 us in the window (a synchronisation shows here);
3. the drafting graph replayed alone under the profiler (the thirty-seventh session's `draft_kernels.py`).

    python results/speed_h200/fortieth_session/first_token.py --out DIR
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function
from transformers import StoppingCriteriaList

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

import hf_bole  # noqa: E402
from eval import run  # noqa: E402
from hf_bole.generation import loop  # noqa: E402
from hf_bole.generation.drafters.mtp import MTPDrafter  # noqa: E402

MODES = {
    "chain d10": {"bole_depth": 10, "bole_topk": 1, "bole_budget": 10},
    "bole d10 b31": {"bole_depth": 10, "bole_topk": 4, "bole_budget": 31},
}
SEGMENTS = ("call", "loop", "prefill", "prefill_end", "rows", "propose", "propose_end", "first_token")
CALL: dict[str, float] = {}


def mark(name: str) -> None:
    """A marker on the profiler's timeline (an empty range), and on the host clock, once a call."""
    if name not in CALL:
        CALL[name] = time.perf_counter()
        with record_function(f"mark:{name}"):
            pass


def instrument() -> None:
    decode, rows_init, propose, prefill = loop._decode, loop._Rows.__init__, MTPDrafter.propose, loop.chain_prefill

    def marked_decode(*args, **kwargs):
        mark("loop")
        return decode(*args, **kwargs)

    def marked_prefill(*args, **kwargs):
        mark("prefill")
        out = prefill(*args, **kwargs)
        mark("prefill_end")
        return out

    def marked_rows(self, *args, **kwargs):
        mark("rows")
        rows_init(self, *args, **kwargs)

    def marked_propose(self, ctx):
        mark("propose")
        tree = propose(self, ctx)
        mark("propose_end")
        return tree

    loop._decode, loop._Rows.__init__, MTPDrafter.propose, loop.chain_prefill = (
        marked_decode, marked_rows, marked_propose, marked_prefill,
    )  # fmt: skip


class FirstToken:
    """A streamer marking the first generated token (generate `put`s the prompt first)."""

    def __init__(self):
        self.puts = 0

    def put(self, value):
        self.puts += 1
        if self.puts == 2:
            mark("first_token")

    def end(self):
        pass


def sync_debug(call, n: int) -> dict:
    """Every synchronising op of `n` calls, by stack: counts before and after the first token."""
    seen = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "hf_bole" in f.filename or "transformers" in f.filename]
        where = " < ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[::-1][:6])
        phase = "after" if "first_token" in CALL else "before"
        seen[(phase, str(message).split("\n")[0][:80], where)] += 1

    with warnings.catch_warnings():  # restores showwarning too
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for i in range(n):
                call(i)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [{"phase": p, "message": m, "stack": s, "count": c} for (p, m, s), c in seen.most_common()]


def timeline(call, n: int, out: Path, label: str) -> list[dict]:
    """Each of `n` calls under the profiler: per segment between markers, host ms, GPU busy ms inside it and the GPU
    time of the kernels launched in it; runtime calls over 50 us before the first token."""
    rows = []
    for i in range(n):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            call(i)
        path = out / f"trace_{label.replace(' ', '_')}_{i}.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
        if i:
            path.unlink()  # keep the first call's trace only
        marks = {e["name"][5:]: e["ts"] for e in events if e.get("name", "").startswith("mark:") and "ts" in e}
        kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
        runtime = {e["args"].get("correlation"): e for e in events if e.get("cat") == "cuda_runtime" and "dur" in e}
        launched = [(runtime[k["args"].get("correlation")]["ts"] if k["args"].get("correlation") in runtime else k["ts"],
                     k) for k in kernels]  # fmt: skip
        names = [s for s in SEGMENTS if s in marks]
        segments = []
        for a, b in zip(names, names[1:]):
            t0, t1 = marks[a], marks[b]
            busy = sum(max(0.0, min(k["ts"] + k["dur"], t1) - max(k["ts"], t0)) for k in kernels)
            own = [k for t, k in launched if t0 <= t < t1]
            segments.append({"from": a, "to": b, "host_ms": (t1 - t0) / 1e3, "gpu_busy_ms": busy / 1e3,
                             "launched_kernels": len(own), "launched_gpu_ms": sum(k["dur"] for k in own) / 1e3})  # fmt: skip
        start, first = marks.get("call"), marks.get("first_token")
        slow = []
        if start is not None and first is not None:
            slow = sorted(
                ({"name": e["name"], "at_ms": (e["ts"] - start) / 1e3, "dur_ms": e["dur"] / 1e3}
                 for e in runtime.values() if start <= e["ts"] < first and e["dur"] > 50),
                key=lambda e: e["at_ms"],
            )  # fmt: skip
            window = [k for k in kernels if start <= k["ts"] < first]
            last_end = max((k["ts"] + k["dur"] for k in window), default=start)
            rows.append({"call": i, "ttft_ms": (first - start) / 1e3, "kernels": len(window),
                         "gpu_busy_ms": sum(k["dur"] for k in window) / 1e3, "last_kernel_end_ms": (last_end - start) / 1e3,
                         "segments": segments, "slow_runtime_calls": slow})  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda", help="cpu: a check of the script (no graphs, no sync debug)")
    ours = ap.parse_args()
    out = Path(ours.out)
    out.mkdir(parents=True, exist_ok=True)
    args = run.parse_args(["--datasets", "mbpp", "--num-prompts", "8", "--max-new-tokens", "128"])
    device = torch.device(ours.device)
    cuda = device.type == "cuda"
    if not cuda:
        torch.cuda.synchronize = torch.cuda.set_sync_debug_mode = lambda *a: None
    run.set_backends(args)
    model, tokenizer, _ = run.load_target(args, device, torch.bfloat16 if cuda else torch.float32)
    _, prompts = next(iter(run.load_prompt_sets(args, model, tokenizer).items()))
    generation = run.generation_kwargs(args, model, tokenizer)
    if cuda:
        hf_bole.warmup(model, 1, verify="closed_form")
    instrument()
    summary = {}
    spec = importlib.util.spec_from_file_location(
        "draft_kernels", ROOT / "results/speed_h200/thirty_seventh_session/draft_kernels.py"
    )
    draft_kernels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(draft_kernels)
    for label, settings in MODES.items():

        def call(i: int) -> None:
            prompt, ids = prompts[i]
            stops = StoppingCriteriaList([run._stop_criterion(tokenizer, tuple(prompt.stop))]) if prompt.stop else None
            torch.cuda.synchronize()
            CALL.clear()
            mark("call")
            model.generate(
                torch.tensor([ids], device=device), attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device),
                streamer=FirstToken(), custom_generate="hf_bole", stopping_criteria=stops, bole_verify="closed_form",
                **generation, **settings,
            )  # fmt: skip
            torch.cuda.synchronize()

        start = time.perf_counter()
        for _ in range(2):
            for i in range(len(prompts)):
                call(i)
        print(f"[{label}] warm passes {time.perf_counter() - start:.1f} s", flush=True)
        syncs = sync_debug(call, len(prompts))
        rows = timeline(call, len(prompts), out, label)
        drafter = next(d for k, d in loop._MTP_DRAFTERS[model].items() if k[:2] == (10, settings["bole_topk"]))
        kernels = draft_kernels.draft_replays(drafter, 30, out, label.replace(" ", "_")) if cuda else None
        summary[label] = {"syncs": syncs, "calls": rows, "draft_kernels": kernels}
        print(f"\n[{label}] synchronising ops over {len(prompts)} calls (phase, count, message, stack):")
        for s in syncs[:20]:
            print(f"  {s['phase']:6} {s['count']:4}  {s['message']}\n         {s['stack']}")
        print(f"[{label}] the first token, median over calls: TTFT {statistics.median(r['ttft_ms'] for r in rows):.2f} ms, "
              f"GPU busy {statistics.median(r['gpu_busy_ms'] for r in rows):.2f} ms in "
              f"{statistics.median(r['kernels'] for r in rows):.0f} kernels, last kernel ends at "
              f"{statistics.median(r['last_kernel_end_ms'] for r in rows):.2f} ms")  # fmt: skip
        print("  | from | to | host ms | GPU busy ms | kernels launched | their GPU ms |")
        for j, seg in enumerate(rows[0]["segments"]):
            med = {k: statistics.median(r["segments"][j][k] for r in rows if len(r["segments"]) > j)
                   for k in ("host_ms", "gpu_busy_ms", "launched_kernels", "launched_gpu_ms")}  # fmt: skip
            print(f"  | {seg['from']} | {seg['to']} | {med['host_ms']:.2f} | {med['gpu_busy_ms']:.2f} | "
                  f"{med['launched_kernels']:.0f} | {med['launched_gpu_ms']:.2f} |")
        print("  runtime calls over 50 us before the first token (call 0):")
        for e in rows[0]["slow_runtime_calls"][:15]:
            print(f"    at {e['at_ms']:.2f} ms: {e['name']} {e['dur_ms']:.3f} ms")
        (out / "first_token.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
