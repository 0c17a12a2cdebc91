"""Where a generate call's time to first token goes: the pieces before hf_bole's first round, each timed with the
GPU synchronised on both sides, for the modes given. Arguments: eval/run.py's (the first batch size and dataset).

    python results/speed_h200/twenty_fourth_session/ttft.py --datasets mbpp --num-prompts 8 --max-new-tokens 128 \\
        --batch-sizes 1 --modes ar chain bole

The twenty-third session's house rows had TTFT 44-57 ms in every mode at batch 1 and 8 (`ar` included) on a 30 MB
model whose whole verify forward replays in about 1 ms: something other than the forward over the prompt is there.
Synchronising inside the call slows it a little; the pieces are what to look at, not their sum.
"""

import collections
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import hf_bole  # noqa: E402
import hf_bole.generation.loop as loop  # noqa: E402
from eval import run  # noqa: E402
from eval.modes import make_modes  # noqa: E402
from hf_bole.generation.drafters.mtp import MTPDrafter  # noqa: E402
from transformers.generation import stopping_criteria  # noqa: E402

TIMES: dict[str, list[float]] = collections.defaultdict(list)
CALL: dict = {}


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(owner, name: str, label: str):
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        sync()
        t = time.perf_counter()
        if label == "_decode entry":
            TIMES["generate -> _decode (transformers' preparation)"].append(t - CALL["start"])
        out = original(*args, **kwargs)
        sync()
        TIMES[label].append(time.perf_counter() - t)
        return out

    setattr(owner, name, wrapper)


def first_call(original, label: str):
    """`original` with its first call in each generate call timed."""
    key = "calls " + label

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        CALL[key] = CALL.get(key, 0) + 1
        if CALL[key] > 1:
            return original(*args, **kwargs)
        sync()
        t = time.perf_counter()
        out = original(*args, **kwargs)
        sync()
        TIMES[label].append(time.perf_counter() - t)
        return out

    return wrapper


def main():
    args = run.parse_args(sys.argv[1:])
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    run.set_backends(args)
    model, tokenizer, label = run.load_target(args, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    dataset, prompts = next(iter(run.load_prompt_sets(args, model, tokenizer).items()))
    generation = run.generation_kwargs(args, model, tokenizer)
    B = args.batch_sizes[0]
    batches = [list(range(i, min(i + B, len(prompts)))) for i in range(0, len(prompts), B)]

    timed(loop, "_decode", "_decode entry")
    timed(loop, "chain_prefill", "chain_prefill")
    timed(loop.BudgetResolver, "for_model", "BudgetResolver.for_model")
    timed(loop, "_make_drafter", "_make_drafter")
    timed(loop, "graphed_cache", "graphed_cache")
    timed(stopping_criteria.StopStringCriteria, "__init__", "StopStringCriteria.__init__")
    MTPDrafter.propose = first_call(MTPDrafter.propose, "drafter's first propose (the prompt's extension)")
    decoder = model.get_decoder()
    decoder.forward = first_call(decoder.forward, "decoder's first forward (ar, eager prefill: the prompt)")
    generate = model.generate

    def generate_timed(*a, **k):
        CALL.clear()
        CALL["start"] = time.perf_counter()
        return generate(*a, **k)

    model.generate = generate_timed
    for name in args.modes:
        (mode,) = make_modes(name, B, args)
        if mode.drafts and device.type == "cuda":
            hf_bole.warmup(model, B, verify=mode.verify or "closed_form")
        for batch in batches:  # untimed: graphs, compiles
            run.run_batch(model, tokenizer, prompts, batch, mode, args, generation, [])
        TIMES.clear()
        ttfts, seconds = [], []
        for _ in range(2):
            for batch in batches:
                record = run.run_batch(model, tokenizer, prompts, batch, mode, args, generation, [])
                ttfts.append(record["ttft"])
                seconds.append(record["seconds"])
        print(f"\n== {mode.label}, batch {B}: TTFT {1e3 * statistics.median(ttfts):.1f} ms median, "
              f"call {1e3 * statistics.median(seconds):.1f} ms median ({len(ttfts)} calls)")  # fmt: skip
        for what, values in TIMES.items():
            print(f"   {what:<52} {1e3 * statistics.median(values):8.2f} ms median of {len(values)}")


if __name__ == "__main__":
    main()
