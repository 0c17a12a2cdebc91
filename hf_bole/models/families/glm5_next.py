"""GLM-5-Next (the text path of `Glm5NextForConditionalGeneration`, text config `glm5_next_text`; transformers has no
text-only class): Kimi Delta Attention layers (as Kimi-Linear's: one short conv over q, k and v concatenated, a
forget gate per key channel, bounded by default by `linear_lower_bound`, a sigmoid-gated output norm) and NoPE MLA
layers ("indexed_attention") with a DSA indexer, hyper-connections (`hc_mult` residual streams mixed in and out of
every block, averaged at the end), dense then MoE MLPs. Its checkpoints carry an MTP layer after the decoder's, which
transformers drops on load and hf_bole does not read.

The indexer caches each token's key, pooling gate logits and padding flag beside the KV (`BoleCache.update_indexer`,
`2 index_head_dim + 1` wide) and pools, every forward, groups of `index_kpool` consecutive tokens from the first real
one; it keeps the `index_topk / index_kpool` best complete groups visible to the query and the tokens after the last
one, and the layer attends to those only. A "shared" layer (`indexer_types`) reuses the previous layer's choice and
caches nothing. Pools are rebuilt from the cached tokens, never cached, so in tree mode each node pools its own
sequence: the committed slots followed by its ancestor path, what decoding the path token by token holds, giving the
same groups and the same tail (`adapter._IndexerView`, through upstream's forward). Where index scores tie exactly,
`torch.topk` picks among the tied groups by the shape of its input, as upstream's own choice changes with the batch
it runs in: tree mode may then keep another of them than decoding does. The indexer's choice is the layer's whole
mask, so the MLA layers always run the model's own attention (`tree_attention_kernel`); the indexer reads the pools
every row holds back to the host (a boolean index), so verify forwards run without CUDA graphs (`cuda_graphs`).

transformers 5.24 sends a one-token input of the KDA layer through `causal_conv1d_update`, which writes the conv
window in place (5.25 asks the cache first): a verify forward runs at least two nodes. 5.17 ships GLM-5-Next with
the indexer taking its cache as `past_key_values`; hf_bole drives the modeling code of 5.24 on. Its RMSNorm
multiplies by `weight` in the model's dtype and its gated norm gates with a sigmoid: both keep transformers'
forward."""

from hf_bole.models.family import Family

GLM5_NEXT = Family(
    name="GLM-5-Next",
    modules={"glm5_next_text": "transformers.models.glm5_next.modeling_glm5_next"},
    classes=("Glm5NextForConditionalGeneration",),
    shipped_in="5.24",
    attention_layers=("indexed_attention",),
    # the KDA layer's q, k and v (one conv input), beta's and the output gate's first projections; the MLA layer's
    # query and compressed KV; the MLP's (or shared experts') gate and up. The forget gate's and the indexer's
    # projections sit in modules of their own.
    projection_groups=(
        ("q_proj", "k_proj", "v_proj", "b_proj", "g_a_proj"),
        ("q_a_proj", "kv_a_proj_with_mqa"),
        ("gate_proj", "up_proj"),
    ),
    kda=True,
    pooled_indexer="Glm5NextTextIndexer",
    min_tree_nodes=2,
    tree_attention_kernel=False,
    cuda_graphs=False,
)
