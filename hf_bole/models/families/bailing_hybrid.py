"""Bailing-Hybrid (Ling 3, e.g. Ling-3.0-flash): Kimi-Linear's kinds of layer (KDA with one short conv over q, k and v
concatenated and a sigmoid-gated output norm; MLA caching compressed latents), differing where tree mode looks in
three ways. The KDA layer's forget gate is bounded by default (`kda_safe_gate`: g = `kda_lower_bound` x
sigmoid(A x (f + dt_bias)), in [lower bound, 0] in log space; else Kimi-Linear's -A x softplus(f + dt_bias)) and cast
to the model's dtype; the layer computes it per token before the recurrence seam, which hands it to `tree_kda_verify`
as it is. The MLA layers rotate the rotary channels of their query and shared key (interleaved pairs, text
positions) and gate their output per head with a sigmoid. The MLPs are dense or MoE by `mlp_layer_types`. Its
checkpoints carry an MTP layer after the decoder's, which transformers drops on load and hf_bole does not read (a
decoder layer, not Qwen3.5's `mtp.*` head).

As for Kimi-Linear, the MLA layers expand their cached latents to query-key and value heads of different sizes after
reading the cache: they always attend through the model's own attention (SDPA or eager) with the tree's ancestor mask;
`attention="triton"` is refused. transformers 5.24 sends a one-token input of the KDA layer through
`causal_conv1d_update`, which writes the conv window in place (5.25 asks the cache first): a verify forward runs at
least two nodes.

Its RMSNorm multiplies by `weight` in the model's dtype and its gated norm gates with a sigmoid: neither is what
hf_bole's norm kernels compute, so both keep transformers' forward."""

from hf_bole.models.family import Family

BAILING_HYBRID = Family(
    name="Bailing-Hybrid",
    modules={"bailing_hybrid": "transformers.models.bailing_hybrid.modeling_bailing_hybrid"},
    classes=("BailingHybridForCausalLM",),
    shipped_in="5.24",
    # the KDA layer's q, k and v (one conv input), beta's and the output gate's projections; the MLA layer's query,
    # compressed KV and head gate (queries without a low-rank projection: `q_lora_rank=None`, the config's default);
    # the MLP's (or shared experts') gate and up. The forget gate's projection sits in a module of its own, apart.
    projection_groups=(
        ("q_proj", "k_proj", "v_proj", "b_proj", "g_proj"),
        ("q_proj", "kv_a_proj_with_mqa", "g_proj"),
        ("gate_proj", "up_proj"),
    ),
    kda=True,
    min_tree_nodes=2,
    tree_attention_kernel=False,
)
