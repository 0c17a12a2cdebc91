"""OLMo-Hybrid: GDN layers (separate q, k, v, a, b and output-gate projections, beta up to 2 with
`linear_allow_neg_eigval`) and full-attention layers in post-norm blocks (no rotary embedding in the released
checkpoints); no MTP head. Its RMSNorm multiplies by `weight` in the model's dtype, and its rotary embedding keeps
cos and sin in float32: neither is what hf_bole's kernels compute, so both keep transformers' forward."""

from hf_bole.models.family import Family

OLMO_HYBRID = Family(
    name="OLMo-Hybrid",
    modules={"olmo_hybrid": "transformers.models.olmo_hybrid.modeling_olmo_hybrid"},
    classes=("OlmoHybridForCausalLM",),
    shipped_in="5.17",
    # the GDN layer's six projections of its input (the output gate's among them), attention's q, k and v
    projection_groups=(
        ("q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj"),
        ("q_proj", "k_proj", "v_proj"),
        ("gate_proj", "up_proj"),
    ),
    gated_norms=("OlmoHybridRMSNormGated",),
)
