"""Kimi-Linear (e.g. Kimi-Linear-48B-A3B): Kimi Delta Attention layers (the gated delta rule with a log-decay per key
channel, one short conv over q, k and v concatenated, a sigmoid-gated output norm) and Multi-head Latent Attention
(MLA) layers without rotary embedding, MoE MLPs after the first dense ones; no MTP head.

MLA caches its compressed latents (`cache.update(latent, rotary_key)`: `hf_bole/cache/layout.py`) and expands them to
its heads after reading the cache, to query-key heads of `qk_nope_head_dim + qk_rope_head_dim` and value heads of
`v_head_dim`, which differ: hf_bole's tree attention kernel takes one head dim, so these layers always attend through
the model's own attention (SDPA or eager) with the tree's ancestor mask, on CUDA too; `attention="triton"` is refused.

transformers 5.17 and 5.24 send a one-token input of the KDA layer through `causal_conv1d_update`, which writes the
conv window in place whenever the cache has one: a verify forward runs at least two nodes.

Its RMSNorm multiplies by `weight` in the model's dtype and its gated norm gates with a sigmoid: neither is what
hf_bole's norm kernels compute, so both keep transformers' forward."""

from hf_bole.models.family import Family

KIMI_LINEAR = Family(
    name="Kimi-Linear",
    modules={"kimi_linear": "transformers.models.kimi_linear.modeling_kimi_linear"},
    classes=("KimiLinearForCausalLM",),
    shipped_in="5.17",
    # the KDA layer's q, k and v (one conv input), the MLP's (or shared experts') gate and up
    projection_groups=(("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")),
    kda=True,
    min_tree_nodes=2,
    tree_attention_kernel=False,
)
