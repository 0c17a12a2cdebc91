"""Qwen3-Next (e.g. Qwen3-Next-80B-A3B): Qwen3.5's layers before it, with the GDN layer's input projections stored
fused (`in_proj_qkvz`, `in_proj_ba`, heads interleaved by key-head group), text position ids, MoE or dense MLPs
(`num_experts=0`), and one MTP layer in the checkpoints, which transformers drops on load."""

from hf_bole.models.family import Family

QWEN3_NEXT = Family(
    name="Qwen3-Next",
    modules={"qwen3_next": "transformers.models.qwen3_next.modeling_qwen3_next"},
    classes=("Qwen3NextForCausalLM",),
    shipped_in="5.17",
    projection_groups=(("in_proj_qkvz", "in_proj_ba"), ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")),
    zero_centred_norms=("Qwen3NextRMSNorm",),
    gated_norms=("Qwen3NextRMSNormGated",),
    rotary=True,
    mtp=True,
)
