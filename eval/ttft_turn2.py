"""Time to the first new token of a conversation's second turn: continuing the first turn's cache against prefilling
the whole conversation again (issue 56's target: at least 5x sooner, with the same tokens).

Turn 1 is an hf_bole call over a random prompt whose output makes `--history` tokens in all; turn 2 adds `--turn` new
tokens and generates `--new`. Arms, each timed from the call to the first generated token reaching the host (a
streamer, as eval/run.py times TTFT):

    bole-continued   hf_bole from a copy of turn 1's returned cache (copied outside the timed call)
    bole-kept        hf_bole from the cache turn 1 returned itself, as a chat loop passes it back (with CUDA graphs
                     the call continues in it, copying no state in); every hf_bole call of the batch size reuses that
                     cache, so it is brought back to turn 1's state outside the timed call
    bole-prefill     hf_bole over the whole conversation
    plain-continued  plain generate from a copy of plain turn 1's DynamicCache
    plain-prefill    plain generate over the whole conversation

Every arm runs once untimed (compiles, CUDA-graph captures), then `--passes` times in turns. The tokens of each arm
are compared with bole-prefill's (in bf16 a near-tie may go either way, so a difference is reported, not raised).
One JSON line out: the machine, the settings, every pass's seconds, the medians and the speed-up.

    python eval/ttft_turn2.py --shape 9B --out runs/ttft_turn2.jsonl    # on a GPU: bf16, random weights
    python eval/ttft_turn2.py --tiny                                     # CPU smoke test: a shrunk shape, fp32

`--profile TRACE.json` adds one more bole-continued call under torch.profiler (host with Python frames and, on a GPU,
device activity): its Chrome trace goes to TRACE.json; the ops taking the most host time and the garbage collector's
passes inside the call are printed.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hf_bole  # noqa: E402,F401  (registers custom_generate="hf_bole")
from eval.metrics import FirstTokenTimer  # noqa: E402
from eval.report import machine  # noqa: E402
from eval.shapes import build_model, shape_config  # noqa: E402

ARMS = ("bole-continued", "bole-kept", "bole-prefill", "plain-continued", "plain-prefill")
# --tiny: a shape small enough for a CPU, the 9B's layer pattern and head dims scaled down
TINY = dict(num_hidden_layers=4, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
            linear_value_head_dim=32, vocab_size=512)  # fmt: skip


def timed(model, ids: torch.Tensor, new: int, **kwargs) -> tuple[float, torch.Tensor]:
    """Seconds from the call to the first generated token on the host, and the generated tokens."""
    timer = FirstTokenTimer()
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, pad_token_id=0, streamer=timer, **kwargs)  # fmt: skip
    sync()
    return timer.first_token_at - start, out[:, ids.shape[1] :]


def profile(model, arm, new: int, trace: str) -> None:
    """One call of `arm` under torch.profiler: its Chrome trace to `trace`, the top ops by host time printed."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    ids, kwargs = arm()
    gc.collect()
    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * ids.is_cuda
    pauses = []  # the garbage collector's passes inside the call: (generation, start, seconds)

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            pauses.append([info["generation"], time.perf_counter(), None])
        elif pauses:
            pauses[-1][2] = time.perf_counter() - pauses[-1][1]

    gc.callbacks.append(on_gc)
    try:
        with profiler(activities=activities, with_stack=True) as prof:  # Python frames: where the host time goes
            start = time.perf_counter()
            s, _ = timed(model, ids, new, **kwargs)
    finally:
        gc.callbacks.remove(on_gc)
    for generation, at, took in pauses:
        took_ms = 1e3 * (took or 0)
        print(f"garbage collection (generation {generation}) at +{1e3 * (at - start):.2f} ms: {took_ms:.2f} ms")
    os.makedirs(os.path.dirname(trace) or ".", exist_ok=True)
    prof.export_chrome_trace(trace)
    print(f"profiled call: first token after {1e3 * s:.2f} ms; trace {trace}")
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=60))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="9B", help="a published shape (hf_bole.shapes.SHAPES)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--history", type=int, default=2000, help="tokens of the conversation after turn 1")
    ap.add_argument("--reply", type=int, default=200, help="of them, tokens turn 1 generated")
    ap.add_argument("--turn", type=int, default=32, help="new tokens of turn 2's question")
    ap.add_argument("--new", type=int, default=16, help="tokens turn 2 generates (the tokens compared)")
    # Passes are a small part of a run (building the model and turn 1 take most of it), and the median of many holds
    # where a busy host slows a few of them.
    ap.add_argument("--passes", type=int, default=15, help="timed passes, the arms in turns")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test: a shrunk shape in fp32, short turns")
    ap.add_argument("--out", default=None, help="a JSONL file the line is appended to")
    ap.add_argument("--profile", default=None, metavar="TRACE.json", help="profile one more bole-continued call")
    args = ap.parse_args(argv)
    if args.tiny:
        args.history, args.reply, args.turn, args.new, args.passes = 96, 16, 8, 4, 2
    dtype = torch.float32 if args.tiny else torch.bfloat16
    model = build_model(shape_config(args.shape, **(TINY if args.tiny else {})), args.device, dtype)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompt = torch.randint(1, vocab, (1, args.history - args.reply), generator=gen).to(args.device)
    question = torch.randint(1, vocab, (1, args.turn), generator=gen).to(args.device)
    # random weights: no MTP head, so the n-gram drafter
    bole = dict(custom_generate="hf_bole", bole_drafter="ngram")

    sequences, caches, returned = {}, {}, {}
    for name, extra in (("bole", bole), ("plain", {})):
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=args.reply,
                             min_new_tokens=args.reply, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                             **extra)  # fmt: skip
        # Copied now: with CUDA graphs hf_bole's next call of this batch size reuses the cache it returned.
        sequences[name], caches[name] = out.sequences, copy.deepcopy(out.past_key_values)
        returned[name] = out.past_key_values
    # Turn 2 continues each turn 1's own conversation (the same tokens, where bf16 did not part them).
    turn2 = {name: torch.cat([s, question], dim=1) for name, s in sequences.items()}

    def kept():
        """The cache turn 1 returned, holding turn 1's state again (the calls since have used it)."""
        cache, saved = returned["bole"], caches["bole"]
        cache.load(saved.state())
        cache.token_ids = saved.token_ids.clone()
        return turn2["bole"], dict(bole, past_key_values=cache)

    arms = {
        "bole-continued": lambda: (turn2["bole"], dict(bole, past_key_values=copy.deepcopy(caches["bole"]))),
        "bole-kept": kept,
        "bole-prefill": lambda: (turn2["bole"], bole),
        "plain-continued": lambda: (turn2["plain"], dict(past_key_values=copy.deepcopy(caches["plain"]))),
        "plain-prefill": lambda: (turn2["plain"], {}),
    }
    seconds: dict[str, list[float]] = {arm: [] for arm in ARMS}
    tokens = {}
    for pass_ in range(args.passes + 1):  # the first pass warms up, untimed
        for arm in ARMS:
            ids, kwargs = arms[arm]()  # the copy is made here, outside the timed call
            # Copying a cache leaves garbage enough to start a full collection inside the call: collected here,
            # outside the timed span, for every arm alike.
            gc.collect()
            s, generated = timed(model, ids, args.new, **kwargs)
            if pass_ > 0:
                seconds[arm].append(s)
            tokens[arm] = generated.tolist()
    if args.profile:
        profile(model, arms["bole-continued"], args.new, args.profile)
    medians = {arm: statistics.median(v) for arm, v in seconds.items()}
    reference = tokens["bole-prefill"]
    line = {
        "machine": machine(),
        "shape": args.shape + (" (tiny)" if args.tiny else ""),
        "dtype": str(dtype).removeprefix("torch."),
        "history": args.history,
        "turn": args.turn,
        "new": args.new,
        "passes": args.passes,
        "seconds": seconds,
        "median_s": medians,
        "speedup_continued_over_prefill": medians["bole-prefill"] / medians["bole-continued"],
        "speedup_kept_over_prefill": medians["bole-prefill"] / medians["bole-kept"],
        "same_tokens_as_bole_prefill": {arm: tokens[arm] == reference for arm in ARMS},
        "turn1_same_tokens": bool(torch.equal(sequences["bole"], sequences["plain"])),
    }
    print(json.dumps(line))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(line) + "\n")
    return line


if __name__ == "__main__":
    main()
