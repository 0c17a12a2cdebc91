"""The sizes of a hybrid model's cached state, read from its text config: what `BoleCache` allocates.

Two kinds of linear-attention layer and two kinds of attention cache are told apart by their config's fields:

    linear attention   Gated DeltaNet (Qwen3.5, Qwen3-Next, OLMo-Hybrid, Lara-Mini): `linear_num_key_heads` q/k heads
                       of `linear_key_head_dim`, `linear_num_value_heads` of `linear_value_head_dim`, one log-decay
                       per head; the conv runs over q, k and v concatenated, `2 Hk K + H V` channels.
                       Kimi Delta Attention (Kimi-Linear, Bailing-Hybrid: `linear_num_heads`, `linear_head_dim`): q,
                       k and v heads alike, a log-decay per key channel (`g [B, T, H, K]`); the conv over `3 H K`
                       channels.
    attention          KV per head (`num_key_value_heads` of `head_dim`, keys and values alike), or MLA's compressed
                       cache (`kv_lora_rank` in the config: Kimi-Linear, Bailing-Hybrid): one "head" whose keys are
                       the normalised latent (`kv_lora_rank` wide) and whose values are the shared rotary key
                       (`qk_rope_head_dim`), which the layer expands to its heads after reading the cache.
                       Qwen4-Exp's "indexed_attention" layers also keep their QSA indexer's raw key per token
                       (`indexer_head_dim` wide, one head), which the indexer pools into blocks of the visible slots;
                       GLM-5-Next's (`index_kpool` in the config) its DSA indexer's per token state packed as
                       `[key, pooling gate logits, valid]` (`2 index_head_dim + 1` wide), which it pools into groups
                       of `index_kpool` tokens.

Qwen4-Exp's per-layer embeddings (`ple_layer_ids`, on some of its GDN layers) keep two windows more in those layers:
the last `ngram_size - 1` tokens, which its n-gram hash reads before each token (the token before the first is eos),
and the last `(ple_conv_kernel_size - 1) x ngram_size` inputs of its dilated conv over `hc_count x hidden_size`
channels.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StateLayout:
    """Per-layer state sizes of one model (see the module docstring)."""

    kv_heads: int
    key_dim: int  # the width of a cached key (MLA: the latent)
    value_dim: int  # the width of a cached value (MLA: the rotary key)
    linear_key_heads: int
    linear_key_dim: int
    linear_value_heads: int
    linear_value_dim: int
    conv_dim: int  # channels of the linear layers' short convolution
    conv_width: int
    per_key_decay: bool  # KDA: a log-decay per key channel; GDN: one per head
    index_key_dim: int = 0  # the width of an indexer's cached state per slot, 0 without an indexer
    index_positions: bool = False  # whether the indexer rotates by the slots' positions (Qwen4-Exp's), then cached
    ple_layers: tuple[int, ...] = ()  # the GDN layers with a per-layer embedding (`ple_layer_ids` less one)
    ple_dim: int = 0  # channels of a per-layer embedding's dilated conv, 0 without per-layer embeddings
    ple_conv_width: int = 0  # the inputs that conv's window keeps
    ple_context: int = 0  # the tokens the n-gram hash reads before each token
    ple_fill: int = 0  # the token before the first one (eos)


def state_layout(config) -> StateLayout:
    """The `StateLayout` of a text config."""
    if getattr(config, "kv_lora_rank", None) is not None:
        kv_heads, key_dim, value_dim = 1, config.kv_lora_rank, config.qk_rope_head_dim
    else:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads, key_dim, value_dim = config.num_key_value_heads, head_dim, head_dim
    per_key_decay = getattr(config, "linear_head_dim", None) is not None
    if per_key_decay:
        hk = hv = config.linear_num_heads
        k = v = config.linear_head_dim
    else:
        hk, k = config.linear_num_key_heads, config.linear_key_head_dim
        hv, v = config.linear_num_value_heads, config.linear_value_head_dim
    return StateLayout(
        kv_heads=kv_heads,
        key_dim=key_dim,
        value_dim=value_dim,
        linear_key_heads=hk,
        linear_key_dim=k,
        linear_value_heads=hv,
        linear_value_dim=v,
        conv_dim=2 * hk * k + hv * v,
        conv_width=config.linear_conv_kernel_dim,
        per_key_decay=per_key_decay,
        index_key_dim=_index_key_dim(config),
        index_positions=getattr(config, "indexer_head_dim", None) is not None,
        **_ple(config),
    )


def _ple(config) -> dict:
    if not getattr(config, "ple_layer_ids", None):
        return {}
    eos = config.eos_token_id
    return dict(
        ple_layers=tuple(i - 1 for i in config.ple_layer_ids),  # one-based in the config
        ple_dim=config.hc_count * config.hidden_size,
        ple_conv_width=(config.ple_conv_kernel_size - 1) * config.ngram_size,
        ple_context=config.ngram_size - 1,
        ple_fill=eos[0] if isinstance(eos, list) else eos,
    )


def _index_key_dim(config) -> int:
    if getattr(config, "index_kpool", None) is not None:
        # GLM-5-Next's DSA indexer caches each token packed as [key, pooling gate logits, valid]
        return 2 * config.index_head_dim + 1
    return getattr(config, "indexer_head_dim", None) or 0
