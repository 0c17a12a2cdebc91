"""Lara-Mini: Qwen3.5's GDN layers, sliding-window attention layers with rotary embeddings and full-attention layers
without (`layer_types` of three kinds), MoE MLPs everywhere; no MTP head. Its RMSNorms apply their weight in float32,
which hf_bole's norm kernels do not: they keep transformers' forward."""

from hf_bole.models.family import Family

LARA_MINI = Family(
    name="Lara-Mini",
    modules={"lara_mini": "transformers.models.lara_mini.modeling_lara_mini"},
    classes=("LaraMiniForCausalLM",),
    shipped_in="5.24",
    attention_layers=("full_attention", "sliding_attention"),
    projection_groups=(
        ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
        ("q_proj", "k_proj", "v_proj"),
        ("gate_proj", "up_proj"),
    ),
    rotary=True,
)
