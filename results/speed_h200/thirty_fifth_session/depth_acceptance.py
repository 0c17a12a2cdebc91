"""Tokens a round against the tree's depth, house model on the CPU (fp32), 8 prompts of a dataset, 128 new tokens,
topk 4, at the budgets of the thirty-third session's format-4 tables (batch 8: bole 384 nodes, tree-serial 96;
batch 1: 32 and 8), each row capped at its width as the loop does (`graphs.row_width`). Not timed: acceptance only,
which does not depend on the device (bf16 on a GPU moves it by a few hundredths). At batch 1 the prompts run one at
a time and the figure is over all their rounds.

    python results/speed_h200/thirty_fifth_session/depth_acceptance.py DATASET BATCH DEPTH...
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import hf_bole  # noqa: F401
from eval import run

BUDGETS = {8: (("closed_form", 384), ("serial", 96)), 1: (("closed_form", 32), ("serial", 8))}


def main(dataset: str, batch: int, depths: list[int]) -> None:
    args = run.parse_args(["--datasets", dataset, "--num-prompts", "8", "--max-new-tokens", "128", "--device", "cpu"])
    model, tokenizer, _ = run.load_target(args, torch.device("cpu"), torch.float32)
    prompts = run.load_prompt_sets(args, model, tokenizer)[dataset]
    generation = run.generation_kwargs(args, model, tokenizer)
    pad = generation["pad_token_id"]
    rows = [p[1] for p in prompts]
    batches = [rows[i : i + batch] for i in range(0, len(rows), batch)]
    for depth in depths:
        line = []
        for verify, budget in BUDGETS[batch]:
            accepted, rounds = 0, 0
            for group in batches:
                P = max(map(len, group))
                ids = torch.tensor([[pad] * (P - len(r)) + r for r in group])
                mask = torch.tensor([[0] * (P - len(r)) + [1] * len(r) for r in group])
                out = model.generate(
                    ids, attention_mask=mask, custom_generate="hf_bole", bole_budget=budget, bole_depth=depth,
                    bole_topk=4, bole_verify=verify, return_dict_in_generate=True, **generation,
                )  # fmt: skip
                played = out.accept_lengths > 0
                accepted += int(out.accept_lengths[played].sum())
                rounds += int(played.sum())
            line.append(f"{verify} {budget}: {accepted / rounds:.3f}")
        print(f"{dataset} batch {batch} depth {depth}: " + ", ".join(line), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), [int(d) for d in sys.argv[3:]])
