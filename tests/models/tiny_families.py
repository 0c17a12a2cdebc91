"""Tiny random models of every GDN and KDA family hf_bole describes (`hf_bole.models.families`), the sizes of `tiny.TEXT`."""

from __future__ import annotations

import pytest
import torch
import transformers

from hf_bole.models import all_families
from tests.models import tiny

# name -> (family name, config class, model class, config fields beyond tiny.TEXT's)
_MOE = dict(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
# Bailing-Hybrid: Kimi-Linear's sizes with Bailing-Hybrid's MLA (rotary on its 8 rotary channels, a gate per head);
# dense MLPs in the first and third layers, MoE (two groups of two experts) in the second and the MLA layer
_BAILING = dict(
    intermediate_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
    num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
    layer_types=["linear_attention"] * 3 + ["full_attention"], mlp_layer_types=["dense", "sparse"] * 2,
)
# two hyper-connection streams, gated attention with a QSA indexer keeping the 2 best blocks of 2 slots (and the
# last incomplete block): prompts and paths are longer, so its choice of blocks counts; partial mRoPE; per-layer
# embeddings in the first and third layers (trigram hashes, a conv of 4 taps 3 apart: 9 inputs back), with eos
# (which starts a new n-gram segment) a token of the first prompt
_QWEN4_EXP = dict(
    _MOE, hc_count=2, hc_lowrank=8, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=4,
    indexer_compress_ratio=2, ple_layer_ids=[1, 3], eos_token_id=2, ngram_vocab_size_base=101, heads_per_ngram=2,
    rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1]
    },
)
MODELS = {
    "qwen3_5-dense": ("Qwen3.5", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(intermediate_size=64)),
    "qwen3_next-moe": ("Qwen3-Next", "Qwen3NextConfig", "Qwen3NextForCausalLM", dict(intermediate_size=64, **_MOE)),
    # num_experts=0: a dense MLP in every layer
    "qwen3_next-dense": (
        "Qwen3-Next", "Qwen3NextConfig", "Qwen3NextForCausalLM", dict(intermediate_size=64, num_experts=0)
    ),
    # rotary embeddings on, which the released checkpoints leave off; beta up to 2 (allow_neg_eigval); GDN head dims
    # no power of two, values twice the keys, as the released checkpoints' 96 and 192
    "olmo_hybrid": (
        "OLMo-Hybrid", "OlmoHybridConfig", "OlmoHybridForCausalLM",
        dict(
            intermediate_size=64, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            linear_key_head_dim=24, linear_value_head_dim=48,
        ),
    ),
    # lin, sliding, lin, full: a window of 6 slots, shorter than the prompts and the trees' paths
    "lara_mini": (
        "Lara-Mini", "LaraMiniConfig", "LaraMiniForCausalLM",
        dict(
            _MOE, layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention"],
            sliding_window=6,
        ),
    ),
    # KDA layers (2 heads of 16, per-channel decays) and an MLA layer (latent 16, rotary key 8, no rotary embedding:
    # Kimi-Linear's MLA is NoPE), a dense MLP in the first layer and MoE after
    "kimi_linear": (
        "Kimi-Linear", "KimiLinearConfig", "KimiLinearForCausalLM",
        dict(
            _MOE, intermediate_size=64, num_key_value_heads=2, bos_token_id=1, kv_lora_rank=16, q_lora_rank=None,
            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, linear_num_heads=2, linear_head_dim=16,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
        ),
    ),
    # the bounded forget gate (kda_safe_gate), with a bound of -0.5 rather than the released -5 so that ancestors'
    # decays count
    "bailing_hybrid-moe": (
        "Bailing-Hybrid", "BailingHybridConfig", "BailingHybridForCausalLM", dict(_BAILING, kda_lower_bound=-0.5)
    ),
    # dense MLPs in every layer, and the unbounded forget gate (Kimi-Linear's -A softplus)
    "bailing_hybrid-dense": (
        "Bailing-Hybrid", "BailingHybridConfig", "BailingHybridForCausalLM",
        dict(_BAILING, kda_safe_gate=False, mlp_layer_types=["dense"] * 4),
    ),
    "qwen4_exp": ("Qwen4-Exp", "Qwen4ExpTextConfig", "Qwen4ExpForCausalLM", _QWEN4_EXP),
    # the same decoder as the text path of Qwen4-Exp's ConditionalGeneration (a tiny vision tower text never reaches)
    "qwen4_exp-vl": ("Qwen4-Exp", "Qwen4ExpConfig", "Qwen4ExpForConditionalGeneration", _QWEN4_EXP),
    # KDA layers as Kimi-Linear's (the forget gate bounded at -0.5, not the released -5, so that ancestors' decays
    # count), NoPE MLA layers with a DSA indexer keeping the 2 best pools of 2 tokens (and the tail after the last
    # complete pool; prompts and paths are longer, so its choice counts), the last layer reusing the third's choice
    # ("shared"); two hyper-connection streams, a dense MLP in the first layer and MoE after. 8 indexer heads: with 2,
    # several pools often score exactly 0 (every head's score ReLU'd), a tie torch.topk breaks by its input's shape
    "glm5_next": (
        "GLM-5-Next", "Glm5NextConfig", "Glm5NextForConditionalGeneration",
        dict(
            intermediate_size=64, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
            num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=0, qk_nope_head_dim=16,
            v_head_dim=16, linear_num_heads=2, linear_head_dim=16, linear_lower_bound=-0.5, index_topk=4,
            index_head_dim=16, index_n_heads=8, index_kpool=2, hc_mult=2, hc_sinkhorn_iters=3,
            layer_types=["linear_attention"] * 2 + ["indexed_attention"] * 2,
            indexer_types=["full"] * 3 + ["shared"], mlp_layer_types=["dense"] + ["sparse"] * 3,
        ),
    ),
}  # fmt: skip
# The vision tower of a composite config (GLM-5-Next's), which text-only inputs never reach
_VISION = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=tiny.TEXT["hidden_size"])


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
    config_class = getattr(transformers, config_name)
    text = {**tiny.TEXT, "eos_token_id": None, **fields, **overrides}
    if "text_config" in config_class.sub_configs:
        config = config_class(text_config=text, vision_config=_VISION, eos_token_id=None)
    else:
        config = config_class(**text)
    config._attn_implementation = attn
    model = getattr(transformers, model_name)(config)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "A_log") and hasattr(module, "dt_bias"):
                module.A_log.copy_(torch.empty_like(module.A_log).uniform_(0.01, 0.5).log())
            if hasattr(module, "ple_embedding"):  # Qwen4-Exp's PLE conv starts at zero, which would hide its taps
                module.conv1d.weight.uniform_(-1, 1)
    return model.eval()
