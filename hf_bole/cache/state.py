"""A hybrid model's committed cache in one form, whichever cache holds it: a `BoleCache`, or a transformers
`DynamicCache` of the model (what plain `generate` returns, or what a plain forward over a prefix fills). Reading one
copies nothing; `BoleCache.load` and `write_dynamic` copy it into a cache.

transformers 5.17-5.25 keep Qwen3.5's state in a `DynamicCache` of one layer object per decoder layer: a `DynamicLayer`
for a full-attention layer (`keys`, `values` `[B, Hkv, L, Dh]`, the L tokens it has seen) and a `LinearAttentionLayer`
for a GDN layer (`conv_states[0]` `[B, D, W]`, the last W pre-conv inputs; `recurrent_states[0]` `[B, H, K, V]`,
float32). Neither says which of the L slots were padding: the attention mask of the next forward does. Qwen4-Exp's
"indexed_attention" layers are `DynamicIndexedLayer`s, whose `indexer_keys` `[B, L, Dx]` are the QSA indexer's keys;
the first of them keeps the slots' position ids for all (`indexer_position_ids`, `[3, B, L]`). GLM-5-Next's keep their
DSA indexer's packed token states there (`[key, pooling gate logits, valid]`), no positions, and its "shared" layers,
which reuse the previous layer's choice, none. Qwen4-Exp's GDN layers with per-layer embeddings keep two conv states
more: `conv_states[1]` `[B, Dp, Sp]` the last inputs of its dilated conv, `conv_states[2]` `[B, Sn]` the last tokens
its n-gram hash reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, DynamicCache, LinearAttentionCacheLayerMixin

from hf_bole.cache.layout import state_layout


@dataclass
class CacheState:
    """The committed state of a hybrid cache: `L` slots of every row.

    Args:
        keys, values: attention layer index -> `[B, Hkv, L, Dh]`.
        conv: GDN layer index -> `[B, D, W]` the last W pre-conv inputs, oldest first (zeros before the first token).
        recurrent: GDN layer index -> `[B, H, K, V]` float32.
        length: `L`, the slots every row holds (left padding included).
        valid: `[B, L]` bool, False at padding slots; None where the cache does not know (a transformers cache).
        token_ids: `[B, L]` the tokens the slots hold, where the cache knows them (a `BoleCache` that an hf_bole call
            returned); else None.
        index_keys: indexed attention layer index -> `[B, L, Dx]` its indexer's state per slot (Qwen4-Exp's QSA keys,
            GLM-5-Next's packed DSA token states; else empty).
        slot_positions: `[B, L]` the slots' position ids, which Qwen4-Exp's indexer rotates by (None without it).
        ple_conv: GDN layer index -> `[B, Dp, Sp]` its per-layer embedding's conv window (Qwen4-Exp's PLE layers).
        ple_tokens: GDN layer index -> `[B, Sn]` int64 its per-layer embedding's n-gram tokens (eos before the first).
    """

    keys: dict[int, torch.Tensor]
    values: dict[int, torch.Tensor]
    conv: dict[int, torch.Tensor]
    recurrent: dict[int, torch.Tensor]
    length: int
    valid: torch.Tensor | None = None
    token_ids: torch.Tensor | None = None
    index_keys: dict[int, torch.Tensor] = field(default_factory=dict)
    slot_positions: torch.Tensor | None = None
    ple_conv: dict[int, torch.Tensor] = field(default_factory=dict)
    ple_tokens: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return next(iter(self.keys.values())).shape[0]


def read_dynamic(cache: Cache, config) -> CacheState:
    """The state a transformers cache of a model of text config `config` holds, checked against the model's layers.

    Raises:
        `ValueError`: a cache of another kind (static, quantized, ...), of another model's layers or shapes, of rows
        of different lengths, or one recording past states for assisted decoding.
    """
    if not isinstance(cache, DynamicCache):
        raise ValueError(
            f"hf_bole continues from a BoleCache (an earlier hf_bole call's) or a DynamicCache (plain generate's, or "
            f"a plain forward's over a prefix), got a {type(cache).__name__}"
        )
    layer_types = list(config.layer_types)
    if len(cache.layers) != len(layer_types):
        raise ValueError(
            f"the cache has {len(cache.layers)} layers but the model {len(layer_types)}: it belongs to another model"
        )
    keys, values, conv, recurrent, index_keys, slot_positions = {}, {}, {}, {}, {}, None
    ple_layers = state_layout(config).ple_layers
    ple_conv, ple_tokens = {}, {}
    for i, (layer, kind) in enumerate(zip(cache.layers, layer_types)):
        if kind == "linear_attention":
            if not isinstance(layer, LinearAttentionCacheLayerMixin):
                raise ValueError(
                    f"layer {i} of the cache is a {type(layer).__name__}, not a GDN (linear attention) layer"
                )
            if layer.record_past:
                raise ValueError(
                    f"layer {i} of the cache records past states for transformers' assisted decoding; hf_bole "
                    f"continues from a cache of committed tokens only"
                )
            if layer.conv_states[0] is not None:
                conv[i], recurrent[i] = layer.conv_states[0], layer.recurrent_states[0]
                if i in ple_layers:  # its per-layer embedding ran before the layer: both windows are there
                    ple_conv[i], ple_tokens[i] = layer.conv_states[1], layer.conv_states[2]
        elif getattr(layer, "is_initialized", False) and layer.keys is not None and layer.keys.numel() > 0:
            keys[i], values[i] = layer.keys, layer.values
            # GLM-5-Next's "shared" indexed layers run no indexer and keep no indexer state
            if kind == "indexed_attention" and layer.indexer_keys is not None:
                index_keys[i] = layer.indexer_keys
                # kept on the first indexed layer for all, by an indexer that rotates by them (Qwen4-Exp's)
                if slot_positions is None and layer.indexer_position_ids is not None:
                    slot_positions = layer.indexer_position_ids[0]
    lengths = {i: k.shape[-2] for i, k in keys.items()}
    length = max(lengths.values(), default=0)
    if any(n != length for n in lengths.values()):
        raise ValueError(f"the cache's attention layers hold different numbers of tokens: {lengths}")
    attention = [i for i, kind in enumerate(layer_types) if kind in ("full_attention", "indexed_attention")]
    gdn = [i for i, kind in enumerate(layer_types) if kind == "linear_attention"]
    if length == 0 and not conv:
        return CacheState({}, {}, {}, {}, 0)
    missing = [i for i in attention if i not in keys] + [i for i in gdn if i not in conv]
    if missing:
        raise ValueError(f"the cache holds {length} tokens but no state in layers {missing}")
    return CacheState(
        keys, values, conv, recurrent, length, index_keys=index_keys, slot_positions=slot_positions,
        ple_conv=ple_conv, ple_tokens=ple_tokens,
    )  # fmt: skip


def write_dynamic(state: CacheState, cache: DynamicCache, config) -> None:
    """Makes `cache` (a transformers `DynamicCache` of a model of text config `config`) hold `state`, in place: its
    layers are refilled through their own update methods, with copies (the state may be another cache's storage)."""
    fresh = DynamicCache(config=config)
    for i in state.keys:
        fresh.layers[i].update(state.keys[i].clone(), state.values[i].clone())
    for n, i in enumerate(state.index_keys):
        fresh.layers[i].update_indexer(state.index_keys[i].clone())
        if n == 0 and state.slot_positions is not None:
            # Qwen4-Exp keeps the slots' positions on the first indexed layer, in its three rotary rows
            fresh.layers[i].indexer_position_ids = state.slot_positions[None].expand(3, -1, -1).clone()
    for i in state.conv:
        layer = fresh.layers[i]
        # A first update takes the window as a prefill's inputs; the recurrent state as it is.
        layer.update_conv_state(state.conv[i].clone())
        layer.update_recurrent_state(state.recurrent[i].clone())
        if i in state.ple_conv:
            layer.update_conv_state(state.ple_conv[i].clone(), state_idx=1)
            layer.update_conv_state(state.ple_tokens[i].clone(), state_idx=2)
        if hasattr(layer, "cumulative_length_linear"):  # transformers 5.25 counts a GDN layer's tokens itself
            layer.cumulative_length_linear.fill_(state.length)
    cache.layers[:] = fresh.layers
