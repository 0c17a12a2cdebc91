"""Plain `generate` against hf_bole on the same prompts: same tokens, fewer target forwards.

    python examples/quickstart.py                         # a tiny random Qwen3.5 built in code (CPU, seconds)
    python examples/quickstart.py --model Qwen/Qwen3.5-9B --drafter mtp --device cuda

Without --model there is no checkpoint, hence no MTP head: the n-gram drafter is used, on prompts that repeat
themselves so that it finds something to propose.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3_5ForCausalLM, Qwen3_5TextConfig

import hf_bole  # noqa: F401  (registers custom_generate="hf_bole")


def tiny_model() -> Qwen3_5ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3_5TextConfig(
        vocab_size=256, hidden_size=128, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
        linear_value_head_dim=32, intermediate_size=256, pad_token_id=0, attn_implementation="sdpa",
    )  # fmt: skip
    return Qwen3_5ForCausalLM(config).eval()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a Qwen3.5 checkpoint (folder or Hub id); default: a tiny random model")
    ap.add_argument("--drafter", default="ngram", choices=["ngram", "mtp"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()

    if args.model:
        tok = AutoTokenizer.from_pretrained(args.model, padding_side="left")
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype="auto", attn_implementation="sdpa")
        model = model.to(args.device).eval()
        texts = ["def fibonacci(n):", "Natalia sold clips to 48 of her friends in April, and then"]
        batch = tok(texts, return_tensors="pt", padding=True).to(args.device)
        ids, mask, pad = batch.input_ids, batch.attention_mask, tok.pad_token_id
    else:
        model = tiny_model().to(args.device)
        # The tiny random model's greedy text loops quickly, which the n-gram drafter then proposes.
        ids = torch.tensor([[7, 8, 9, 10, 7, 8, 9, 10, 7, 8], [0, 0, 0, 21, 22, 23, 21, 22, 23, 21]], device=args.device)
        mask, pad = (ids != 0).long(), 0
    common = dict(attention_mask=mask, max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=pad)

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


if __name__ == "__main__":
    main()
