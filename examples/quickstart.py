"""Plain `generate` against hf_bole on the same prompts: same tokens, fewer target forwards.

    python examples/quickstart.py                         # the house model in eval/house/checkpoint (CPU is enough)
    python examples/quickstart.py --model Qwen/Qwen3.5-9B --device cuda

The default drafter is the checkpoint's MTP head (`mtp.*` weights), as in any Qwen3.5 checkpoint.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_bole  # noqa: F401  (registers custom_generate="hf_bole")

HOUSE_MODEL = Path(__file__).resolve().parents[1] / "eval" / "house" / "checkpoint"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(HOUSE_MODEL), help="a Qwen3.5 checkpoint (folder or Hub id)")
    ap.add_argument("--drafter", default="mtp", choices=["mtp", "ngram"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()

    tok = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype="auto", attn_implementation="sdpa")
    model = model.to(args.device).eval()
    texts = ["def fibonacci(n):", "Question: Natalia sold clips to 48 of her friends in April, and then"]
    batch = tok(texts, return_tensors="pt", padding=True).to(args.device)
    ids, mask = batch.input_ids, batch.attention_mask
    common = dict(attention_mask=mask, max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)

    for name, extra in (
        ("plain generate", {}),
        ("hf_bole", dict(custom_generate="hf_bole", bole_drafter=args.drafter, return_dict_in_generate=True)),
    ):
        model.generate(ids, **common, **extra)  # warm-up
        if args.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(ids, **common, **extra)
        if args.device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        sequences = out.sequences if extra else out
        new = (sequences.shape[1] - ids.shape[1]) * ids.shape[0]
        note = f", {out.mean_accepted_tokens:.2f} tokens per verify round" if extra else ""
        print(f"{name:>15}: {new / seconds:8.1f} tokens/s{note}")
        if not extra:
            reference = sequences
    print("identical greedy output:", torch.equal(sequences, reference))
    if args.device == "cpu":
        print("(on a CPU the tokens/s move with the machine's load; hf_bole is built for GPUs)")


if __name__ == "__main__":
    main()
