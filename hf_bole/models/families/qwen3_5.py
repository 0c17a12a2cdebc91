"""Qwen3.5 and Qwen3.5-MoE: three GDN layers for every gated full-attention layer (partial rotary, mRoPE position
ids), zero-centred RMSNorms, one MTP layer in the checkpoints."""

from hf_bole.models.family import Family

QWEN3_5 = Family(
    name="Qwen3.5",
    modules={
        "qwen3_5_text": "transformers.models.qwen3_5.modeling_qwen3_5",
        "qwen3_5_moe_text": "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
    },
    classes=(
        "Qwen3_5ForCausalLM",
        "Qwen3_5MoeForCausalLM",
        "Qwen3_5ForConditionalGeneration",
        "Qwen3_5MoeForConditionalGeneration",
    ),
    shipped_in="5.17",
    mrope=True,
    # the GDN layer's four input projections, attention's q (with its gate), k and v, the MLP's (or shared expert's)
    # gate and up
    projection_groups=(
        ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
        ("q_proj", "k_proj", "v_proj"),
        ("gate_proj", "up_proj"),
    ),
    zero_centred_norms=("Qwen3_5RMSNorm", "Qwen3_5MoeRMSNorm"),
    gated_norms=("Qwen3_5RMSNormGated", "Qwen3_5MoeRMSNormGated"),
    rotary=True,
    mtp=True,
)
