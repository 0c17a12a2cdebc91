"""Where the host's time in a round goes: Python's cProfile over warm generate calls of the modes given (the first
batch size and dataset). Arguments: eval/run.py's.

    python results/speed_h200/twenty_fifth_session/host_profile.py --datasets mbpp --num-prompts 8 \\
        --max-new-tokens 128 --batch-sizes 1 --modes bole

At batch 1 on the house model a bole round's phases take about as long on the host clock as on the device
timeline (3.0 ms), and the draft phase's device span is about twice its graph's kernels: the GPU waits for Python.
cProfile slows Python down; the shares of the functions are what to look at.
"""

import cProfile
import io
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import hf_bole  # noqa: E402
from eval import run  # noqa: E402
from eval.modes import make_modes  # noqa: E402


def main():
    args = run.parse_args(sys.argv[1:])
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    run.set_backends(args)
    model, tokenizer, _ = run.load_target(args, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    _, prompts = next(iter(run.load_prompt_sets(args, model, tokenizer).items()))
    generation = run.generation_kwargs(args, model, tokenizer)
    B = args.batch_sizes[0]
    batches = [list(range(i, min(i + B, len(prompts)))) for i in range(0, len(prompts), B)]
    for name in args.modes:
        (mode,) = make_modes(name, B, args)
        if mode.drafts and device.type == "cuda":
            hf_bole.warmup(model, B, verify=mode.verify or "closed_form")
        for batch in batches:  # untimed: graphs, compiles
            run.run_batch(model, tokenizer, prompts, batch, mode, args, generation, [])
        profile = cProfile.Profile()
        rounds = 0
        profile.enable()
        for batch in batches:
            record = run.run_batch(model, tokenizer, prompts, batch, mode, args, generation, [])
            rounds += len(record["accept_lengths"]) // len(batch)
        profile.disable()
        for sort in ("tottime", "cumulative"):
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats(sort).print_stats(45)
            print(f"\n== {mode.label}, batch {B}, {rounds} rounds, by {sort}\n{text.getvalue()}")


if __name__ == "__main__":
    main()
