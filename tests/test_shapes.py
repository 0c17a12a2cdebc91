"""hf_bole.shapes: the published Qwen3.5 shapes as in DESIGN.md §8 and Qwen3-Next-80B-A3B (checked without building
them), and shrunken ones built."""

from __future__ import annotations

import pytest
import torch

from hf_bole import shapes
from hf_bole.shapes import SHAPES, build_model, parameter_bytes, shape_config
from tests.models import tiny, tiny_families

# DESIGN.md §8: hidden, layers, attention heads/kv, GDN k/v heads, FFN (dense) or (experts, top-k, expert, shared).
TABLE = {
    "4B": (2560, 32, 16, 4, 16, 32, 9216),
    "9B": (4096, 32, 16, 4, 16, 32, 12288),
    "27B": (5120, 64, 24, 4, 16, 48, 17408),
    "35B-A3B": (2048, 40, 16, 2, 16, 32, (256, 8, 512, 512)),
    "122B-A10B": (3072, 48, 32, 2, 16, 64, (256, 8, 1024, 1024)),
}


@pytest.mark.parametrize("name", list(TABLE))
def test_shape_config(name):
    c = shape_config(name)
    hidden, layers, heads, kv, gdn_k, gdn_v, ffn = TABLE[name]
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (
        hidden,
        layers,
        heads,
        kv,
    )
    assert (c.linear_num_key_heads, c.linear_num_value_heads) == (gdn_k, gdn_v)
    if isinstance(ffn, tuple):
        assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.shared_expert_intermediate_size) == ffn
    else:
        assert c.intermediate_size == ffn and not hasattr(c, "num_experts")
    assert (c.vocab_size, c.head_dim, c.linear_key_head_dim, c.linear_value_head_dim) == (248320, 256, 128, 128)
    assert c.linear_conv_kernel_dim == 4 and c.mtp_num_hidden_layers == 1
    assert c.rope_parameters["partial_rotary_factor"] == 0.25
    assert c.layer_types == ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * (
        layers // 4
    )
    # The name is the parameter count (total, for MoE), within the embeddings' share.
    billions = parameter_bytes(c, torch.bfloat16) / 2 / 1e9
    assert abs(billions - float(name.split("B")[0])) / float(name.split("B")[0]) < 0.25


@pytest.mark.parametrize("name, layers, billions", [("Qwen3-Next-80B-A3B", 48, 79.7), ("Qwen3-Next-80B-A3B-40L", 40, 66.5)])
def test_qwen3_next_shape_config(name, layers, billions):
    """transformers' Qwen3NextConfig defaults, the 80B-A3B's (its docstring), or 40 of their layers."""
    c = shape_config(name)
    assert c.model_type == "qwen3_next" and c.num_hidden_layers == layers
    assert (c.vocab_size, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (
        151936, 2048, 16, 2, 256
    )
    assert (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim) == (16, 32, 128)
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.shared_expert_intermediate_size) == (
        512, 10, 512, 512
    )
    assert c.layer_types == ["linear_attention"] * 3 + ["full_attention"] + c.layer_types[4:]
    assert c.layer_types.count("full_attention") == layers // 4
    assert abs(parameter_bytes(c, torch.bfloat16) / 2 / 1e9 - billions) < 0.1


KDA_SHAPES = {  # name: (model type, layers, of them MLA, billions of parameters)
    "Kimi-Linear-48B-A3B": ("kimi_linear", 27, 6, 49.1),
    "Kimi-Linear-48B-A3B-16L": ("kimi_linear", 16, 3, 28.7),
    "Ling-3.0-flash-12L": ("bailing_hybrid", 12, 2, 31.9),
    "Ling-3.0-flash-24L": ("bailing_hybrid", 24, 4, 68.9),
}


@pytest.mark.parametrize("name", list(KDA_SHAPES))
def test_kda_shape_config(name):
    """transformers' KimiLinearConfig and BailingHybridConfig defaults (Kimi-Linear-48B-A3B's, Ling-3.0-flash's), or
    fewer of their layers; a transformers without the class says so."""
    model_type, layers, mla, billions = KDA_SHAPES[name]
    if not shapes.available(name):
        with pytest.raises(ValueError, match="install a newer transformers"):
            shape_config(name)
        return
    c = shape_config(name)
    assert c.model_type == model_type and c.num_hidden_layers == layers
    assert c.layer_types.count("full_attention") == mla and c.layer_types.count("linear_attention") == layers - mla
    assert abs(parameter_bytes(c, torch.bfloat16) / 2 / 1e9 - billions) < 0.1


@pytest.mark.parametrize("family", tiny_families.params(["kimi_linear", "bailing_hybrid-moe"]))
def test_build_kda_shape_shrunken(family):
    """A KDA shape shrunk to the tiny family's sizes builds, its forget gates made slow as for GDN, and decodes."""
    name = "Kimi-Linear-48B-A3B" if family == "kimi_linear" else "Ling-3.0-flash-12L"
    *_, fields = tiny_families.MODELS[family]
    model = build_model(shape_config(name, **{**tiny.TEXT, **fields}), "cpu", torch.float32, seed=1)
    gates = [m for m in model.modules() if hasattr(m, "A_log") and hasattr(m, "dt_bias")]
    assert gates and all((m.A_log.float().exp() <= 16.1).all() for m in gates)
    ids = torch.randint(0, tiny.TEXT["vocab_size"], (2, 7))
    assert model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0).shape == (2, 11)


def test_shape_of_a_class_transformers_lacks(monkeypatch):
    assert shapes.available("Kimi-Linear-48B-A3B") and shapes.available("9B")
    monkeypatch.setitem(shapes.CLASSES, "kimi_linear", ("NoSuchConfig", "NoSuchForCausalLM"))
    assert not shapes.available("Kimi-Linear-48B-A3B")
    with pytest.raises(ValueError, match="Kimi-Linear-48B-A3B needs transformers' NoSuchConfig"):
        shape_config("Kimi-Linear-48B-A3B")


def test_shapes_listed():
    assert set(SHAPES) == set(TABLE) | {"Qwen3-Next-80B-A3B", "Qwen3-Next-80B-A3B-40L"} | set(KDA_SHAPES)


@pytest.mark.parametrize("name", ["9B", "35B-A3B", "Qwen3-Next-80B-A3B"])
def test_build_model_shrunken(name):
    small = dict(
        vocab_size=101, hidden_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    )  # fmt: skip
    if "A3B" in name:
        small.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
        if "Next" in name:
            small.update(intermediate_size=96)
    else:
        small.update(intermediate_size=96)
    model = build_model(shape_config(name, **small), "cpu", torch.bfloat16, seed=1)
    assert model.dtype == torch.bfloat16 and model.device.type == "cpu"
    assert model.config._attn_implementation == "sdpa"
    for layer in model.model.layers:
        if layer.block_type == "linear_attention":
            A = layer.linear_attn.A_log.float().exp()
            dt = torch.nn.functional.softplus(layer.linear_attn.dt_bias.float())
            assert (A >= 0.99).all() and (A <= 16.1).all()
            assert (dt >= 0.9e-3).all() and (dt <= 0.11).all()  # per-token decay exp(-A dt) between 0.2 and 1
    ids = torch.randint(0, 101, (2, 7))
    out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 11)


def test_shape_config_rejects_unknown(tmp_path):
    with pytest.raises(ValueError, match="a shape must be one of 4B, 9B"):
        shape_config("7B")
    with pytest.raises(ValueError, match="a shape must be one of .* or a checkpoint folder with a config.json"):
        shape_config(str(tmp_path))


def test_shape_config_of_a_folder(tmp_path):
    """A checkpoint folder's text config, composite (vision-language) or not, with overrides."""
    from transformers import Qwen3_5Config

    text = shape_config("9B", num_hidden_layers=4)
    Qwen3_5Config(text_config=text.to_dict(), vision_config={"depth": 1}).save_pretrained(tmp_path)
    config = shape_config(str(tmp_path), hidden_size=512)
    assert config.model_type == "qwen3_5_text" and config.num_hidden_layers == 4 and config.hidden_size == 512


def test_random_shape_has_a_clear_greedy_answer_in_bf16():
    """Wide and deep enough that transformers' own random weights leave bf16 ties among the top logits (then
    tree and plain decoding part on rounding noise and the oracle loses track): every position's best logit
    must beat the second by far more than bf16 rounding."""
    config = shape_config("9B", vocab_size=2048, hidden_size=1024, num_hidden_layers=8, intermediate_size=2048)
    model = build_model(config, "cpu", torch.bfloat16, seed=0)
    with torch.no_grad():
        logits = model(torch.randint(0, 2048, (1, 24))).logits[0].float()
    top = logits.topk(2, dim=-1).values
    assert (top[:, 0] - top[:, 1]).min() > 0.5 * top[:, 0].abs().max()  # bf16 rounds at 2^-8 of the value
