"""Where a batch-1 generate call's wall time goes, per variant, passes in turns over every prompt.

For each call it records the wall time, the first token's time (TTFT: the first generated token handed to the
streamer), the time before hf_bole's loop starts (transformers' `generate` preparing its inputs), and every wait of
the host for the GPU (the loop's one wait a round, in `_Rows.read`); the first of those waits is the first token's.
Per round it reports the decode's wall time (wall - TTFT) over the rounds against the host's wait: a round whose
wait is near zero is bound by the host, and then "host work" (the rest) is what the round costs. The way to the
first token is taken apart on the host's clock too: the loop's set-up and the prompt's prefill (to the token
bookkeeping's start, `_Rows`), the drafter's first call (which extends its cache by the prompt eagerly), the rest of
the first round's launches, and the wait for the first token.

Variants are `label=setting=value,...` of `bole_*` settings (`chain d6=depth=6,topk=1,budget=6`); the rest of the
arguments are eval/run.py's (model, dataset, prompts, new tokens, repeats).

    python results/speed_h200/thirty_eighth_session/round_wait.py --datasets mbpp --num-prompts 8 \
        --max-new-tokens 128 --repeats 6 --out rw.json --variant "chain d6=depth=6,topk=1,budget=6" \
        --variant "bole d10=depth=10"
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

import hf_bole
from eval import run
from eval.modes import Mode, make_modes
from hf_bole.generation import loop
from hf_bole.generation.drafters.mtp import MTPDrafter

START = time.perf_counter()
CALL: dict = {}  # the call under way: its loop's start and its host waits


def stage(what: str) -> None:
    print(f"[{time.perf_counter() - START:6.1f} s] {what}", flush=True)


def instrument() -> None:
    decode, read, rows_init, propose = loop._decode, loop._Rows.read, loop._Rows.__init__, MTPDrafter.propose

    def timed_decode(*args, **kwargs):
        CALL["loop_start"] = time.perf_counter()
        out = decode(*args, **kwargs)
        CALL["loop_s"] = time.perf_counter() - CALL["loop_start"]
        return out

    def timed_read(self, written):
        start = time.perf_counter()
        written.ready.synchronize()  # `read` waits here itself; its own wait then returns at once
        CALL.setdefault("first_read", start)
        CALL.setdefault("waits", []).append(time.perf_counter() - start)
        return read(self, written)

    def timed_rows_init(self, *args, **kwargs):
        CALL.setdefault("rows", time.perf_counter())  # made right after the prefill and the first token's launches
        rows_init(self, *args, **kwargs)

    def timed_propose(self, ctx):
        start = time.perf_counter()
        tree = propose(self, ctx)
        CALL.setdefault("propose", (start, time.perf_counter()))
        return tree

    loop._decode = timed_decode
    loop._Rows.read = timed_read
    loop._Rows.__init__ = timed_rows_init
    MTPDrafter.propose = timed_propose


def parse_variant(text: str) -> tuple[str, dict]:
    label, _, settings = text.partition("=")
    values = {}
    for item in filter(None, settings.split(",")):
        key, _, value = item.partition("=")
        values[key] = int(value) if value.lstrip("-").isdigit() else value
    return label, values


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", required=True)
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
    stage("ar reference")
    variants = {}
    for text in ours.variant:
        name, settings = parse_variant(text)
        chain = settings.get("topk") == 1
        variants[name] = Mode("chain" if chain else "bole", settings.pop("depth"), settings.pop("topk", 4),
                              settings.pop("budget", "auto"), 0.3, "closed_form", label=name)  # fmt: skip
        variants[name].extra = {f"bole_{k}": v for k, v in settings.items()}
    if cuda:
        hf_bole.warmup(model, 1, verify="closed_form")
    instrument()

    def timed_pass(name: str) -> list[dict]:
        calls = []
        mode = variants[name]
        for batch, ref in zip(batches, reference):
            CALL.clear()
            record = run.run_batch(model, tokenizer, prompts, batch, mode, args, {**generation, **mode.extra}, [ref])
            waits = CALL.get("waits", [0.0])
            loop_start, rows, (propose_start, propose_end) = CALL["loop_start"], CALL["rows"], CALL["propose"]
            calls.append({
                # the way to the first token on the host's clock, in turn
                "to_rows": rows - loop_start, "to_propose": propose_start - rows,
                "first_propose": propose_end - propose_start, "to_first_read": CALL["first_read"] - propose_end,
                "seconds": record["seconds"], "ttft": record["ttft"], "tokens": len(record["tokens"][0]),
                "rounds": sum(1 for a in record["accept_lengths"] if a > 0),
                "exact": all(d is None for d in record["divergences"] or [None]),
                "loop_s": CALL["loop_s"],
                "first_wait": waits[0], "round_waits": sum(waits[1:]),
            })  # fmt: skip
        return calls

    for name in variants:  # compiles and captures, untimed
        start = time.perf_counter()
        timed_pass(name)
        stage(f"{name}: first pass {time.perf_counter() - start:.1f} s")
    passes = {name: [] for name in variants}
    for turn in range(args.repeats):
        order = list(variants) if turn % 2 == 0 else list(variants)[::-1]
        for name in order:
            passes[name].append(timed_pass(name))
        stage(f"turn {turn}: " + ", ".join(
            f"{k} {sum(c['tokens'] for c in v[-1]) / sum(c['seconds'] for c in v[-1]):.1f}" for k, v in passes.items()
        ))  # fmt: skip
    rows = []
    for name, runs in passes.items():
        per_pass = []
        for calls in runs:
            seconds = sum(c["seconds"] for c in calls)
            rounds = sum(c["rounds"] for c in calls)
            decode = sum(c["seconds"] - c["ttft"] for c in calls)
            per_pass.append({
                "tokens_per_s": sum(c["tokens"] for c in calls) / seconds,
                "ttft_ms": 1e3 * statistics.mean(c["ttft"] for c in calls),
                # the call outside hf_bole's loop: transformers' `generate` before it (and its return after it)
                "prep_ms": 1e3 * statistics.mean(c["seconds"] - c["loop_s"] for c in calls),
                "first_wait_ms": 1e3 * statistics.mean(c["first_wait"] for c in calls),
                **{f"{k}_ms": 1e3 * statistics.mean(c[k] for c in calls)
                   for k in ("to_rows", "to_propose", "first_propose", "to_first_read")},
                "tokens_per_round": sum(c["tokens"] for c in calls) / rounds,
                "round_ms": 1e3 * decode / rounds,
                "round_wait_ms": 1e3 * sum(c["round_waits"] for c in calls) / rounds,
                "exact": all(c["exact"] for c in calls),
            })  # fmt: skip
        mid = sorted(per_pass, key=lambda p: p["tokens_per_s"])[(len(per_pass) - 1) // 2]
        rows.append({"variant": name, "settings": variants[name].generate_kwargs("mtp") | variants[name].extra,
                     "median_pass": mid, "passes": per_pass})  # fmt: skip
    Path(ours.out).write_text(json.dumps({"model": label, "dataset": dataset, "rows": rows,
                                          "gpu": torch.cuda.get_device_name(device) if cuda else "cpu",
                                          "versions": {"torch": torch.__version__}}, indent=1))  # fmt: skip
    print(f"\n{label}, {dataset}, batch 1, {len(batches)} prompts, {args.max_new_tokens} new tokens, median pass of "
          f"{args.repeats} (by tokens/s)")
    table(rows, ("tokens/s", "TTFT ms", "prep ms", "first wait ms", "tokens/round", "round ms", "wait/round ms",
                 "host work/round ms", "exact"),
          lambda p: (f"{p['tokens_per_s']:.1f}", f"{p['ttft_ms']:.2f}", f"{p['prep_ms']:.2f}",
                     f"{p['first_wait_ms']:.2f}", f"{p['tokens_per_round']:.2f}", f"{p['round_ms']:.3f}",
                     f"{p['round_wait_ms']:.3f}", f"{p['round_ms'] - p['round_wait_ms']:.3f}", str(p["exact"])))
    print("\nThe way to the first token, host clock, ms (prep: transformers' generate before the loop; set-up and "
          "prefill: the loop's start to `_Rows`; first propose: the drafter's first call, its eager extension by the "
          "prompt included; rest of round 1: to the first read)")
    table(rows, ("TTFT", "prep", "set-up and prefill", "to first propose", "first propose", "rest of round 1",
                 "first wait"),
          lambda p: tuple(f"{p[k]:.2f}" for k in ("ttft_ms", "prep_ms", "to_rows_ms", "to_propose_ms",
                                                   "first_propose_ms", "to_first_read_ms", "first_wait_ms")))


def table(rows: list[dict], columns: tuple[str, ...], cells) -> None:
    """A Markdown table of `rows`, one line a variant: `cells(median pass)` under `columns`."""
    print("| variant | " + " | ".join(columns) + " |")
    print("|---|" + "---:|" * len(columns))
    for row in rows:
        print(f"| {row['variant']} | " + " | ".join(cells(row["median_pass"])) + " |")

if __name__ == "__main__":
    main()
