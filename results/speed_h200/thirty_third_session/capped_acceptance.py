"""Tokens a round with every row capped at a given number of draft nodes, house model on the CPU (fp32), MBPP,
8 prompts at batch 8, 128 new tokens, depth 6, topk 4, fixed budgets; and how often the widest row kept (uncapped)
passes 16, 32 and 48 columns. Not timed: acceptance only.

    python results/speed_h200/thirty_third_session/capped_acceptance.py

The loop's cap (`row_width`) is swapped for one that allows `cap` nodes to every row, through the loop's `MAX_NODES`.
"""

import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import hf_bole  # noqa: E402, F401
from eval import run  # noqa: E402
from hf_bole.generation import graphs, loop  # noqa: E402


def main() -> None:
    args = run.parse_args(["--datasets", "mbpp", "--num-prompts", "8", "--max-new-tokens", "128", "--device", "cpu"])
    model, tokenizer, _ = run.load_target(args, torch.device("cpu"), torch.float32)
    prompts = run.load_prompt_sets(args, model, tokenizer)["mbpp"]
    generation = run.generation_kwargs(args, model, tokenizer)
    rows = [p[1] for p in prompts]
    P, pad = max(map(len, rows)), generation["pad_token_id"]
    ids = torch.tensor([[pad] * (P - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (P - len(r)) + [1] * len(r) for r in rows])
    widths = []
    trimmed = graphs.trimmed

    def recorded(verify):
        widths.append(int(verify.num_nodes.max()))
        return trimmed(verify)

    loop.trimmed = recorded  # without graphs, several rows: every round's widest row kept
    loop.row_width = lambda budget, active_rows, max_width: max_width  # rows capped by MAX_NODES alone
    for verify, budget in (("closed_form", 192), ("closed_form", 256), ("serial", 64)):
        for cap in (64, 48, 32, 16):
            loop.MAX_NODES = cap  # the loop allows MAX_NODES - 1 draft nodes to a row
            widths.clear()
            out = model.generate(
                ids, attention_mask=mask, custom_generate="hf_bole", bole_budget=budget, bole_depth=6, bole_topk=4,
                bole_verify=verify, return_dict_in_generate=True, **generation,
            )  # fmt: skip
            over = collections.Counter((w > 16) + (w > 32) + (w > 48) for w in widths)
            shares = [sum(n for k, n in over.items() if k >= j) / len(widths) for j in (1, 2, 3)]
            over = " / ".join(f"{s:.0%}" for s in shares)
            print(f"{verify} budget {budget} cap {cap - 1}: {out.mean_accepted_tokens:.3f} tokens a round, "
                  f"widest row > 16 / 32 / 48 in {over} of rounds", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
