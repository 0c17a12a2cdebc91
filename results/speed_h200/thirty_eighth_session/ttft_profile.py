"""Where the host's time before the first token goes, batch 1 on the house model: cProfile over warm generate calls
(each prompt once per pass), for calls of 1 new token (the way to the first token and one round) and of the full
length, per mode. On an H200 the first token's wait for the GPU was 0.01 ms (round_wait.py): that time is the host's.

    python results/speed_h200/thirty_eighth_session/ttft_profile.py --out DIR [--new-tokens 128]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import StoppingCriteriaList

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import hf_bole  # noqa: F401
from eval import metrics, run

MODES = {
    "bole d10": {"bole_depth": 10},
    "chain d6": {"bole_depth": 6, "bole_topk": 1, "bole_budget": 6},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--new-tokens", type=int, default=128)
    ours = ap.parse_args()
    out = Path(ours.out)
    out.mkdir(parents=True, exist_ok=True)
    args = run.parse_args(["--datasets", "mbpp", "--num-prompts", "8", "--max-new-tokens", str(ours.new_tokens)])
    cuda = torch.cuda.is_available()
    device = torch.device("cuda") if cuda else torch.device("cpu")
    run.set_backends(args)
    model, tokenizer, _ = run.load_target(args, device, torch.bfloat16 if cuda else torch.float32)
    _, prompts = next(iter(run.load_prompt_sets(args, model, tokenizer).items()))
    generation = run.generation_kwargs(args, model, tokenizer)

    def call(i: int, mode: str, new_tokens: int) -> tuple[float, float]:
        prompt, ids = prompts[i]
        stops = StoppingCriteriaList([run._stop_criterion(tokenizer, tuple(prompt.stop))]) if prompt.stop else None
        timer = metrics.FirstTokenTimer()
        torch.cuda.synchronize() if cuda else None
        start = time.perf_counter()
        model.generate(
            torch.tensor([ids], device=device), attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device),
            streamer=timer, custom_generate="hf_bole", stopping_criteria=stops,
            **{**generation, "max_new_tokens": new_tokens}, **MODES[mode],
        )  # fmt: skip
        torch.cuda.synchronize() if cuda else None
        return time.perf_counter() - start, (timer.first_token_at or time.perf_counter()) - start

    lines = []
    for mode in MODES:
        for new_tokens in (ours.new_tokens, 1):
            for _ in range(2):  # compiles, captures, then warm
                for i in range(len(prompts)):
                    call(i, mode, new_tokens)
            timed = [call(i, mode, new_tokens) for i in range(len(prompts)) for _ in range(3)]
            lines.append(f"{mode}, {new_tokens} new: wall {1e3 * statistics.median(t for t, _ in timed):.2f} ms, "
                         f"TTFT {1e3 * statistics.median(f for _, f in timed):.2f} ms (median of {len(timed)})")
            print(lines[-1], flush=True)
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(2):
                for i in range(len(prompts)):
                    call(i, mode, new_tokens)
            profile.disable()
            name = f"{mode.replace(' ', '_')}_{new_tokens}"
            profile.dump_stats(out / f"{name}.prof")
            for key in ("cumulative", "tottime"):
                text = io.StringIO()
                stats = pstats.Stats(profile, stream=text)
                stats.sort_stats(key).print_stats(70)
                (out / f"{name}_{key}.txt").write_text(text.getvalue())
    (out / "ttft_profile.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
