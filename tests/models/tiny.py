"""Tiny random Qwen3.5 models, random draft trees, and the plain-decoding references tree tests compare to."""

from __future__ import annotations

import copy

import torch
from transformers import (
    DynamicCache,
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
)

VOCAB = 97
TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=4,  # lin, lin, lin, full
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    pad_token_id=0,
    initializer_range=0.1,  # larger activations than the default, so that errors show in the logits
)


def text_config(kind: str = "dense", **overrides) -> Qwen3_5TextConfig | Qwen3_5MoeTextConfig:
    fields = {**TEXT, **overrides}
    if kind == "moe":
        moe = dict(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
        return Qwen3_5MoeTextConfig(**fields, **moe)
    return Qwen3_5TextConfig(**fields, intermediate_size=64)


def build_model(kind: str = "dense", attn: str = "sdpa", **overrides):
    """A tiny fp32 model: "dense", "moe" (ForCausalLM) or "vl" (dense ForConditionalGeneration, text only);
    `overrides` change text config fields."""
    torch.manual_seed(0)
    if kind == "vl":
        vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=TEXT["hidden_size"])
        config = Qwen3_5Config(text_config=text_config(**overrides).to_dict(), vision_config=vision)
        config._attn_implementation = attn
        model = Qwen3_5ForConditionalGeneration(config)
    else:
        config = text_config(kind, **overrides)
        config._attn_implementation = attn
        model = (Qwen3_5MoeForCausalLM if kind == "moe" else Qwen3_5ForCausalLM)(config)
    # Upstream draws the GDN decay rate A up to 16, so the state forgets almost everything within a token and
    # tree mistakes in it would hardly show; slow decays make every ancestor count.
    with torch.no_grad():
        for layer in model.get_decoder().layers:
            if layer.block_type == "linear_attention":
                gdn = layer.linear_attn
                gdn.A_log.copy_(torch.empty_like(gdn.A_log).uniform_(0.01, 0.5).log())
    return model.eval()


def left_pad(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """`(input_ids, attention_mask)`, both `[B, T]`, left-padded with token 0."""
    T = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (T - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def generate_positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids as `generate` numbers them: real tokens from 0, padding at 0."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


@torch.no_grad()
def prefill(model, cache, prompts: list[list[int]]) -> torch.Tensor:
    """Prefills `cache` with left-padded `prompts` like `generate` does; returns the greedy next tokens `[B]`."""
    ids, mask = (x.to(model.device) for x in left_pad(prompts))
    out = model(ids, attention_mask=mask, position_ids=generate_positions(mask), past_key_values=cache)
    return out.logits[:, -1].argmax(-1)


def random_tree(n: int, max_depth: int, gen: torch.Generator) -> list[int]:
    """Parents of an n-node tree rooted at node 0, in topological order, no deeper than `max_depth`."""
    parents, depth = [-1], [0]
    while len(parents) < n:
        p = int(torch.randint(0, len(parents), (1,), generator=gen))
        if depth[p] < max_depth:
            parents.append(p)
            depth.append(depth[p] + 1)
    return parents


def batch_trees(trees: list[list[int]]) -> torch.Tensor:
    """`[B, N]` parents, rows padded with nodes of parent -1."""
    N = max(len(t) for t in trees)
    return torch.tensor([t + [-1] * (N - len(t)) for t in trees])


def random_tree_logits(model, seed: int = 3) -> torch.Tensor:
    """The logits of one `tree_forward` over three random trees (9, 6 and 12 nodes, depth <= 4) after three
    left-padded prompts: what the tests of the modules a tree forward swaps compare with and without the swap."""
    from hf_bole.cache import BoleCache
    from hf_bole.models import tree_forward

    gen = torch.Generator(torch.get_default_device()).manual_seed(seed)
    parents = batch_trees([random_tree(n, max_depth=4, gen=gen) for n in (9, 6, 12)])
    tokens = torch.randint(1, VOCAB, parents.shape, generator=gen)
    cache = BoleCache(model.config, batch_size=3)
    tokens[:, 0] = prefill(model, cache, [[5, 17, 33, 2, 41, 9, 60], [71, 3, 28, 44], [13]])
    return tree_forward(model, cache, tokens, parents).logits


def path_to(parents: list[int], i: int) -> list[int]:
    path = []
    while i >= 0:
        path.append(i)
        i = parents[i]
    return path[::-1]


def random_path(parents: list[int], gen: torch.Generator) -> list[int]:
    """A random root-to-node path of a tree."""
    return path_to(parents, int(torch.randint(0, len(parents), (1,), generator=gen)))


@torch.no_grad()
def reference_cache(model, tokens: list[int]) -> DynamicCache:
    """transformers' own cache after a plain forward over `tokens` (batch 1, no padding)."""
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    model(torch.tensor([tokens], device=model.device), past_key_values=cache)
    return cache


@torch.no_grad()
def reference_tree_logits(model, committed: list[int], tokens: list[int], parents: list[int]) -> torch.Tensor:
    """`[n, vocab]`: the logits of every node when its root-to-node path is decoded token by token after the
    plain model has consumed `committed`."""
    base = reference_cache(model, committed)
    states, logits = [], []
    for token, parent in zip(tokens, parents):
        cache = copy.deepcopy(base if parent < 0 else states[parent])
        logits.append(model(torch.tensor([[token]], device=model.device), past_key_values=cache).logits[0, -1])
        states.append(cache)
    return torch.stack(logits)
