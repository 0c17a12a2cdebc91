"""Greedy exactness of every GDN and KDA family on real-shape random models in bf16 (issues 58, 59): plain `generate`
against hf_bole with the oracle drafter (deep accepted paths) and with the n-gram drafter, a left-padded batch.

    python eval/check_families.py --layers 8 --new 64
    python eval/check_families.py --families Kimi-Linear Bailing-Hybrid --layers 8

Each family's shape is transformers' config defaults for it (Qwen3.5: `hf_bole.shapes`' 9B; Qwen4-Exp: see `FIELDS`),
cut to `--layers` decoder layers (every layer as the shape's; the layer pattern the config makes for that count) so that
every family fits one GPU (Kimi-Linear: the 48B-A3B shape; of 8 layers one is MLA, and the experts take ~26 GB in bf16.
Bailing-Hybrid: `BailingHybridConfig()`, whose docstring names inclusionAI/Ling-3.0-Flash and whose 42 layers count
124.4B parameters, 5.1B active without the embedding, as published for Ling-3.0-flash (124B, ~5.1B active); of 8 layers
one is MLA and six are MoE, 36 GiB in bf16. GLM-5-Next: `Glm5NextConfig()`'s text config, through the text path of
`Glm5NextForConditionalGeneration`; of 8 layers two are MLA with a DSA indexer and five are MoE of 288 experts, 74 GiB
in bf16: one H200, or `--families GLM-5-Next --layers 4` on an H100, 19 GiB). Weights are random, made decodable by
`hf_bole.shapes.trained_like`; OLMo-Hybrid's attention blocks normalise after their output projections, so their
post-norms are scaled down instead. Where an output differs from plain decoding, the line names the first differing step
and plain decoding's gap between its two best logits there: a gap within bf16 rounding of the logits is a near-tie (the
verify forward's kernels round differently, as DESIGN.md §6 explains), a wide one a bug.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hf_bole  # noqa: E402, F401  (registers custom_generate="hf_bole")
from eval.oracle import OracleDrafter  # noqa: E402
from hf_bole.models import all_families  # noqa: E402
from hf_bole.shapes import CLASSES, LAYER_OUTPUT_SCALE, build_model, shape_config  # noqa: E402

# family name -> model type (`hf_bole.shapes.CLASSES`); Qwen3.5's config is hf_bole.shapes' 9B
MODELS = {
    "Qwen3.5": "qwen3_5_text",
    "Qwen3-Next": "qwen3_next",
    "OLMo-Hybrid": "olmo_hybrid",
    "Lara-Mini": "lara_mini",
    "Kimi-Linear": "kimi_linear",
    "Bailing-Hybrid": "bailing_hybrid",
    "GLM-5-Next": "glm5_next",
    "Qwen4-Exp": "qwen4_exp_text",
}
# Fields beyond the config defaults. Qwen4-Exp's defaults (hidden 2048, 512 experts of which 10 a token, head dim 256)
# leave its QSA indexer unset, which the config refuses for indexed attention layers, and its per-layer embedding
# (PLE) off: the check gives the indexer 16 query heads of 128 and one key head (an index head of 128 then needs the
# partial rotary factor 0.25 of Qwen3.5's attention), pools blocks of 4 tokens and keeps 32 tokens, so that it selects
# within the check's sequences of at most 101 tokens, and puts PLE on layers 2 and 6 with n-gram tables of about
# 100,000 rows a head instead of 20 million (8 layers: about 14B parameters, 28 GB in bf16).
FIELDS = {
    "Qwen4-Exp": dict(
        indexer_n_heads=16, indexer_kv_heads=1, indexer_head_dim=128, indexer_compress_ratio=4, indexer_budget=32,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000, "partial_rotary_factor": 0.25},
        ple_layer_ids=[2, 6], ngram_vocab_size_base=100_000, eos_token_id=2,
    ),
}


def build(family: str, layers: int, device: torch.device, dtype: torch.dtype, overrides: dict, seed: int = 0):
    model_type = MODELS[family]
    fields = {**FIELDS.get(family, {}), "num_hidden_layers": layers, **overrides}
    config_class = getattr(transformers, CLASSES[model_type][0])
    if model_type == "qwen3_5_text":
        config = shape_config("9B", **fields)
    elif "text_config" in config_class.sub_configs:  # GLM-5-Next: the text config of a ConditionalGeneration model
        config = config_class(text_config=fields)
    else:
        config = config_class(**fields)
    model = build_model(config, device, dtype, seed)
    with torch.no_grad():
        for layer in model.get_decoder().layers:
            if hasattr(layer, "post_feedforward_layernorm"):  # OLMo-Hybrid's post-norm attention blocks
                for norm in (layer.post_attention_layernorm, layer.post_feedforward_layernorm):
                    norm.weight.mul_(LAYER_OUTPUT_SCALE)
    return model


def first_difference(ours: torch.Tensor, ref: torch.Tensor) -> int | None:
    diff = (ours != ref).nonzero()
    return int(diff[:, 1].min()) if len(diff) else None


@torch.no_grad()
def check(model, family: str, args) -> int:
    """Greedy hf_bole against plain generate on three left-padded random prompts, oracle then n-gram drafter: the
    number of drafters whose output differs."""
    device = model.device
    failed = 0
    vocab = model.get_output_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(1)
    lengths = (37, 20, 5)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):  # left padding
        ids[b, -n:] = torch.randint(1, vocab, (n,), generator=gen)
        mask[b, -n:] = 1
    ids, mask = ids.to(device), mask.to(device)
    common = dict(attention_mask=mask, max_new_tokens=args.new, do_sample=False, pad_token_id=0, eos_token_id=None)
    plain = model.generate(ids, output_logits=True, return_dict_in_generate=True, **common)
    ref = plain.sequences[:, ids.shape[1] :]
    continuations = [row.tolist() for row in ref]
    oracle = OracleDrafter(lengths, continuations, depth=6, topk=4, accept=0.8, vocab_size=vocab)
    for label, drafter in (("oracle", oracle), ("ngram", "ngram")):
        out = model.generate(ids, custom_generate="hf_bole", bole_drafter=drafter, return_dict_in_generate=True,
                             **common)  # fmt: skip
        ours = out.sequences[:, ids.shape[1] :]
        step = first_difference(ours, ref)
        line = f"{family} ({type(model).__name__}, {args.layers} layers, {args.dtype}) {label}: "
        line += f"{out.mean_accepted_tokens:.2f} accepted/round, "
        if step is None:
            print(line + "identical to plain generate")
            continue
        top2 = torch.stack(plain.logits).float().topk(2, dim=-1).values[step]  # [B, 2] at the first difference
        gaps = (top2[:, 0] - top2[:, 1]).tolist()
        print(line + f"differs from step {step}; plain decoding's top-2 logit gaps there {gaps}")
        failed += 1
    return failed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--new", type=int, default=64, help="new tokens per prompt")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--override", nargs="*", default=[], metavar="FIELD=INT", help="config fields of every family")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    overrides = {k: int(v) for k, v in (o.split("=") for o in args.override)}
    available = {f.name for f in all_families() if f.available}
    failed = 0
    for family in args.families:
        if family not in available:
            print(f"{family}: not in transformers {transformers.__version__}")
            continue
        try:
            failed += check(build(family, args.layers, device, dtype, overrides), family, args)
        except Exception:  # one family's failure must not hide the others': name it, go on
            traceback.print_exc()
            print(f"{family}: raised (above)")
            failed += 1
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the next family's weights where this one's were
    return failed


if __name__ == "__main__":
    sys.exit(int(main() > 0))
