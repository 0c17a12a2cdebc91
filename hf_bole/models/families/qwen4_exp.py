"""Qwen4-Exp (`Qwen4ExpForCausalLM`, and the text path of `Qwen4ExpForConditionalGeneration`): Qwen3.5's GDN layers and
gated attention layers with a QSA indexer ("indexed_attention"), hyper-connections (`hc_count` residual streams mixed
in and out of every block, no final norm), MoE MLPs everywhere, mRoPE position ids; `mtp.*` weights in its
checkpoints, which transformers drops on load and hf_bole does not read (their layout is not known to be Qwen3.5's
head).

The indexer picks, per query, the blocks of `indexer_compress_ratio` consecutive visible slots whose pooled keys score
highest (plus the last incomplete block) and narrows the layer's mask to them. Its per-token keys are cached beside the
KV (`BoleCache.update_indexer`) and the slots' positions with them (`indexer_position_ids`), each tree node's at its
own slot: a node's visible slots, in slot order, are its path's tokens in order, so it pools the blocks decoding the
path token by token pools. The narrowed mask is what the model's own attention reads; hf_bole's tree attention kernel
would attend to every visible slot, so these layers always run the model's attention (`tree_attention_kernel`). The
indexer finds each query's visible slots with `torch.nonzero`, a read back to the host: verify forwards run without
CUDA graphs (`cuda_graphs`).

Per-layer embeddings (PLE, `ple_layer_ids`, on some GDN layers) hash each token with its `ngram_size - 1`
predecessors and run a dilated conv over the last `(ple_conv_kernel_size - 1) x ngram_size` inputs: two windows more in
those layers (conv states 1 and 2), which a BoleCache keeps beside the GDN conv's. In a tree forward each node reads
them along its own path (`per_layer_embeddings`: the hash over the tokens before it on its path, the dilated conv as a
tree conv with zero taps between the dilated ones), and the commit moves both windows along the accepted path as the
GDN conv's. transformers 5.17's Qwen4-Exp keeps the indexer's positions on the cache object itself,
which a BoleCache does not: hf_bole drives the modeling code of 5.24 on. Its RMSNorms normalise groups of the
hyper-connection streams and its gated norm may gate with a sigmoid (`output_gate_type`): they keep transformers'
forward, as does its rotary embedding (mRoPE sections recomposed per channel)."""

from hf_bole.models.family import Family

QWEN4_EXP = Family(
    name="Qwen4-Exp",
    modules={"qwen4_exp_text": "transformers.models.qwen4_exp.modeling_qwen4_exp"},
    classes=("Qwen4ExpForCausalLM", "Qwen4ExpForConditionalGeneration"),
    shipped_in="5.24",
    mrope=True,
    attention_layers=("indexed_attention",),
    # the GDN layer's four input projections, attention's q (with its gate), k and v (the indexer's own projection
    # sits in a module of its own), the shared expert's gate and up
    projection_groups=(
        ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
        ("q_proj", "k_proj", "v_proj"),
        ("gate_proj", "up_proj"),
    ),
    per_layer_embeddings=("Qwen4ExpTextNGramEmbedding", "Qwen4ExpTextPLELayer"),
    tree_attention_kernel=False,
    cuda_graphs=False,
)
