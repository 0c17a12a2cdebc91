"""The harness's shapes (eval/shapes.py): the house model's, and a shape built across devices by accelerate."""

from __future__ import annotations

import pytest
import torch

from eval.shapes import HOUSE_CHECKPOINT, _mapped_device, build_model, build_model_across, shape_config


@pytest.mark.skipif(not HOUSE_CHECKPOINT.is_dir(), reason="the house checkpoint is committed with the repository")
def test_house_shape():
    config = shape_config("house")
    assert config.model_type == "qwen3_5_text" and config.hidden_size == 384


SMALL_MOE = dict(
    vocab_size=101, hidden_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
)  # fmt: skip


def test_build_model_across_initialises_as_build_model():
    """Built on the meta device, placed by accelerate and made weight by weight where the map says (here all on
    the CPU): every weight initialised as `build_model` initialises it (same distributions; the random draws come
    in another order), so the model decodes; the map is recorded."""
    config = shape_config("122B-A10B", **SMALL_MOE)
    across = build_model_across(config, torch.float32, max_memory={"cpu": 2**30}, seed=1)
    ref = build_model(shape_config("122B-A10B", **SMALL_MOE), "cpu", torch.float32, seed=1).requires_grad_(False)
    assert set(across.hf_device_map.values()) == {"cpu"}
    expected = dict(ref.named_parameters())
    for name, p in across.named_parameters():
        want = expected[name]
        assert p.shape == want.shape and p.dtype == want.dtype and torch.isfinite(p).all(), name
        if want.std() == 0:  # constants (norms)
            assert torch.equal(p, want), name
        elif p.numel() >= 256:  # a draw of the same distribution (a few per head, as the GDN decays, vary more)
            assert abs(float(p.std() / want.std()) - 1) < 0.2, name
    # The unembedding is the embedding, permuted (and the embedding scaled after): the same rows.
    rows = lambda w: torch.sort(w.float().sum(1)).values  # noqa: E731
    torch.testing.assert_close(rows(across.lm_head.weight) * 10, rows(across.model.embed_tokens.weight))
    out = across.generate(torch.randint(0, 101, (2, 7)), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 11)


def test_build_model_across_refuses_offload():
    with pytest.raises(ValueError, match="do not fit in max_memory.*offloaded to the CPU or disk"):
        build_model_across(shape_config("122B-A10B", **SMALL_MOE), torch.float32, max_memory={"cpu": 2**16})


def test_mapped_device():
    device_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1, "lm_head": 1}
    assert _mapped_device(device_map, "model.layers.1.mlp.experts.gate_up_proj") == torch.device("cuda", 1)
    assert _mapped_device(device_map, "model.layers.0.input_layernorm.weight") == torch.device("cuda", 0)
    assert _mapped_device({"": "cpu"}, "lm_head.weight") == torch.device("cpu")
