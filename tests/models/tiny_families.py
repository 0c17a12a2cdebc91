"""Tiny random models of every GDN family hf_bole describes (`hf_bole.models.families`), the sizes of `tiny.TEXT`."""

from __future__ import annotations

import pytest
import torch
import transformers

from hf_bole.models import all_families
from tests.models import tiny

# name -> (family name, config class, model class, config fields beyond tiny.TEXT's)
_MOE = dict(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
MODELS = {
    "qwen3_5-dense": ("Qwen3.5", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(intermediate_size=64)),
    "qwen3_next-moe": ("Qwen3-Next", "Qwen3NextConfig", "Qwen3NextForCausalLM", dict(intermediate_size=64, **_MOE)),
    # num_experts=0: a dense MLP in every layer
    "qwen3_next-dense": (
        "Qwen3-Next", "Qwen3NextConfig", "Qwen3NextForCausalLM", dict(intermediate_size=64, num_experts=0)
    ),
    # rotary embeddings on, which the released checkpoints leave off; beta up to 2 (allow_neg_eigval)
    "olmo_hybrid": (
        "OLMo-Hybrid", "OlmoHybridConfig", "OlmoHybridForCausalLM",
        dict(intermediate_size=64, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    ),
    # lin, sliding, lin, full: a window of 6 slots, shorter than the prompts and the trees' paths
    "lara_mini": (
        "Lara-Mini", "LaraMiniConfig", "LaraMiniForCausalLM",
        dict(
            _MOE, layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention"],
            sliding_window=6,
        ),
    ),
}  # fmt: skip


def family(name: str):
    return next(f for f in all_families() if f.name == MODELS[name][0])


def available(name: str) -> bool:
    return family(name).available


def params(names=None):
    """`pytest.param`s of the models `names` (default all), skipped where this transformers version lacks them."""
    return [
        pytest.param(n, id=n, marks=pytest.mark.skipif(not available(n), reason=f"{n} needs another transformers"))
        for n in (names or MODELS)
    ]


def build(name: str, attn: str = "sdpa", **overrides):
    """A tiny fp32 model of `MODELS[name]`, with slow GDN decays as `tiny.build_model` makes them."""
    _, config_name, model_name, fields = MODELS[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**{**tiny.TEXT, "eos_token_id": None, **fields, **overrides})
    config._attn_implementation = attn
    model = getattr(transformers, model_name)(config)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "A_log") and hasattr(module, "dt_bias"):
                module.A_log.copy_(torch.empty_like(module.A_log).uniform_(0.01, 0.5).log())
    return model.eval()
