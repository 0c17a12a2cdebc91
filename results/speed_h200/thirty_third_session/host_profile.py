"""Where a bole round's host time goes: `cProfile` over generate calls of the house model (MBPP, 8 prompts, batch 8,
128 new tokens, CUDA graphs, no phase timer), bole and tree-serial at the tables' budgets, each warmed up first.
Prints the functions with the most own time, then those with the most cumulative time.

    python results/speed_h200/thirty_third_session/host_profile.py --calls 10
"""

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from eval import run  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--top", type=int, default=30)
    ours = ap.parse_args()
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
    for verify in ("closed_form", "serial"):
        kwargs = dict(attention_mask=mask, custom_generate="hf_bole", bole_depth=6, bole_topk=4, bole_verify=verify,
                      return_dict_in_generate=True, **extra, **generation)  # fmt: skip
        for _ in range(3):
            out = model.generate(ids, **kwargs)
        torch.cuda.synchronize()
        rounds, start = 0, time.perf_counter()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(ours.calls):
            out = model.generate(ids, **kwargs)
            rounds += out.accept_lengths.shape[1]
        torch.cuda.synchronize()
        profiler.disable()
        wall = time.perf_counter() - start
        print(f"\n==== {verify}: {ours.calls} calls, {rounds} rounds, {1e3 * wall / rounds:.3f} ms a round under "
              f"cProfile, {out.mean_accepted_tokens:.2f} tokens a round")  # fmt: skip
        stats = pstats.Stats(profiler)
        stats.sort_stats("tottime").print_stats(ours.top)
        stats.sort_stats("cumulative").print_stats(45)


if __name__ == "__main__":
    main()
