"""BoleCache: the committed state of a hybrid (GDN + full attention) model per batch row, and the commit that keeps
only each row's accepted path of a tree round (`TreeRound`, the scratch one verify forward fills).

Storage (allocated once, written in place with `copy_`/`scatter_`, so addresses stay put for CUDA graphs):

    keys, values   [NA, B, Hkv, C, Dk|Dv] full-attention KV of the NA attention layers, slot s of row b is the
                                         s-th token of that row's sequence (left padding included); MLA's compressed
                                         cache keeps the latent as keys and the rotary key as values (`layout.py`)
    conv           [NG, B, D, W]         conv windows of the linear layers (GDN or KDA; transformers' layout: last W
                                         pre-conv inputs, oldest first), D = 2 Hk K + H V
    recurrent      [NG, B, H, K, V]      recurrent states, float32, stacked so that one `tree_gdn_commit` (or
                                         `tree_kda_commit`) launch updates every linear layer
    index_keys     [NI, B, C, Dx]        the indexer's state per slot of the NI "indexed_attention" layers with an
                                         indexer of their own: Qwen4-Exp's raw QSA key, GLM-5-Next's packed DSA token
                                         state (`layout.py`; NI = 0 elsewhere)
    slot_positions [B, C]                the position id of every slot, which Qwen4-Exp's indexer rotates its pooled
                                         blocks' keys by (None without such an indexer)
    ple_conv       [NP, B, Dp, Sp]       the windows of the NP per-layer embeddings (Qwen4-Exp's PLE, on some linear
                                         layers; `layout.py`): the last Sp inputs of each one's dilated conv
    ple_tokens     [NP, B, 1, Sn]        and the last Sn tokens its n-gram hash reads (eos before the first token)
    lengths        [B]                   committed slots per row (left padding included)
    positions      [B]                   position id of each row's next token
    valid          [B, C]                False on padding slots

The layers' state (keys to index_keys, ple_conv and ple_tokens) is stacked per device (`_DeviceGroup`): on one device
one set for all layers; for a model spread over devices by accelerate's `device_map`, one set per device, holding the
layers that run there, so that every layer's state stays on its own device and the commit is one launch per device. The
bookkeeping (lengths, positions, valid, the tree's parents and mask) lives on the first layer's device; what a device
group needs of it is copied there once per round.

A tree round (`tree_mode(parents, tree_round)`) writes the tree's KV into the free slots right after each row's
committed ones (slot `lengths[b] + i` for node i), and keeps in `tree_round` the per-node GDN factors (k, u,
log-decay) or, for the serial baseline, per-node state snapshots, together with every node's pre-conv input. The
round is a value: the verify forward fills it and hands it on, and `commit(tree_round, path)` then moves the accepted
nodes' KV (and indexer keys and slot positions) into place, applies Eq. 10 to all GDN layers at once (its
per-key-channel form to KDA layers, whose factors keep the layer's g in place of the log-decay) and rebuilds the conv
windows. The cache holds no round outside the forward, and the committed state is never touched before `commit`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, LinearAttentionCacheLayerMixin

from hf_bole.cache.state import CacheState
from hf_bole.config import VERIFY_MODES
from hf_bole.cache.layout import state_layout
from hf_bole.kernels import (
    kv_commit,
    tree_conv_state_commit,
    tree_gdn_commit,
    tree_gdn_commit_serial,
    tree_kda_commit,
    tree_masks,
)
from hf_bole.kernels.kv_move import commit_slots_torch
from hf_bole.kernels.utils import check_parents, check_path, is_capturing
from hf_bole.placement import placement
from hf_bole.tensor_parallel import tensor_parallel

# layers with KV (a sliding window's is kept whole; an indexed layer's with its indexer's keys)
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "indexed_attention")
INDEXED_LAYER = "indexed_attention"  # attention with an indexer: Qwen4-Exp's QSA, GLM-5-Next's DSA
KV_GROWTH_STEP = 64  # a growing cache's KV capacity is a multiple of this many slots


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _extend(t: torch.Tensor, dim: int, extra: int, fill) -> torch.Tensor:
    """`t` with `extra` more entries along `dim`, filled with `fill` (a new tensor: growth moves storage)."""
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t, torch.full(shape, fill, dtype=t.dtype, device=t.device)], dim=dim)


@dataclass
class GDNTreeState:
    """What a GDN layer hands to `BoleCache.update_recurrent_state` in tree mode, in place of a new state.

    Closed form (`verify="closed_form"`): the factors of `tree_gdn_verify` (or `tree_kda_verify`), from which
    `commit` builds the state after any accepted path (Eq. 10). Serial (`verify="serial"`): the state after every node.

    Args:
        use_qk_l2norm: whether the verify kernel L2-normalised q and k (the commit must do the same to k).
        key: `[B, N, Hk, K]` the keys given to the verify kernel (closed form).
        u: `[B, N, H, V]` float32 delta-rule writes (closed form).
        log_decay: `[B, N, H]` float32 inclusive sums of g along each node's path (GDN, closed form).
        g: `[B, N, H, K]` the log-decays per key channel given to the verify kernel (KDA, closed form).
        snapshots: `[B, N, H, K, V]` float32 state after every node (serial).
    """

    use_qk_l2norm: bool
    key: torch.Tensor | None = None
    u: torch.Tensor | None = None
    log_decay: torch.Tensor | None = None
    g: torch.Tensor | None = None
    snapshots: torch.Tensor | None = None

    def to(self, *args, **kwargs) -> GDNTreeState:
        """Itself: the KDA layers (Kimi-Linear's; Bailing-Hybrid's in transformers 5.24) cast what the recurrence
        returns to float32 before handing it to the cache (`.to(torch.float32)`), and the factors are already what the
        commit reads."""
        return self


@dataclass
class _DeviceGroup:
    """The committed state of the layers that run on one device (NA attention and NG GDN layers of the group)."""

    device: torch.device
    keys: torch.Tensor  # [NA, B, Hkv, C, Dk]
    values: torch.Tensor  # [NA, B, Hkv, C, Dv]
    conv: torch.Tensor  # [NG, B, D, W]
    recurrent: torch.Tensor  # [NG, B, H, K, V] float32
    index_keys: torch.Tensor  # [NI, B, C, Dx] the indexed layers' indexer keys
    ple_conv: torch.Tensor  # [NP, B, Dp, Sp] the per-layer embeddings' conv windows
    ple_tokens: torch.Tensor  # [NP, B, 1, Sn] int64 their n-gram hashes' token windows


@dataclass
class _GroupRound:
    """A device group's scratch of one tree round, on its device."""

    slots: torch.Tensor | None  # [B, N] KV slot of every node, lengths[b] + i (set by `tree_mode`)
    # [NG, B, N, D] every GDN layer's pre-conv input of every node, token-major (what `commit` reads)
    conv_io: torch.Tensor
    keys: torch.Tensor | None  # [NG, B, N, Hk, K] (closed form)
    u: torch.Tensor | None  # [NG, B, N, H, V] float32 (closed form)
    log_decay: torch.Tensor | None  # [NG, B, N, H] float32 (GDN, closed form)
    g: torch.Tensor | None  # [NG, B, N, H, K] float32 (KDA, closed form)
    snapshots: list[torch.Tensor | None] = field(default_factory=list)  # NG x [B, N, H, K, V] (serial)
    ple_io: torch.Tensor | None = None  # [NP, B, N, Dp] every per-layer embedding's conv input of every node
    ple_token_io: torch.Tensor | None = None  # [NP, B, N, 1] int64 every node's token, for the n-gram windows


@dataclass(eq=False)
class TreeRound:
    """The scratch of one tree-verification round: what the verify forward leaves for `BoleCache.commit`. Made by
    `BoleCache.new_round`; a later forward of the same shape may fill the same buffers again (their addresses then
    stay put, as the CUDA graphs that capture the forward and the commit need).

    Args:
        parents: `[B, N]` the tree's parents, on the cache's (first) device.
        verify: "closed_form" (factors) or "serial" (snapshots).
        groups: one `_GroupRound` per device group of the cache.
        tree_kv_bytes: bytes of the tree's KV, which the forward writes into the cache's free slots.
        use_qk_l2norm: whether the verify kernels L2-normalised q and k (the commit does the same to k).
        verified_from: the committed state the last forward verified from (`BoleCache.mark_verified`), None before.
    """

    parents: torch.Tensor
    verify: str
    groups: list[_GroupRound]
    tree_kv_bytes: int
    use_qk_l2norm: bool = True
    verified_from: int | None = None

    @property
    def transient_bytes(self) -> dict[str, int]:
        """Bytes of the round's tree state: GDN factors (k, u, log-decay; closed form), per-node state snapshots
        (serial), every node's pre-conv input (`conv_inputs`), and the tree's KV (written in place into the free slots
        of the cache's KV storage, so not a separate allocation)."""
        out = {"factors": 0, "snapshots": 0, "conv_inputs": 0, "tree_kv": self.tree_kv_bytes}
        for g in self.groups:
            out["factors"] += _nbytes(g.keys) + _nbytes(g.u) + _nbytes(g.log_decay) + _nbytes(g.g)
            out["snapshots"] += sum(_nbytes(s) for s in g.snapshots)
            out["conv_inputs"] += _nbytes(g.conv_io) + _nbytes(g.ple_io) + _nbytes(g.ple_token_io)
        return out


class BoleAttentionLayer(CacheLayerMixin):
    """A full-attention layer of a `BoleCache`: views into the cache's stacked per-row KV storage."""

    is_compileable = False
    is_sliding = False
    supports_early_init = False

    def __init__(self, cache: BoleCache, layer_idx: int):
        # The base initialiser would set `keys`/`values` attributes; here they are views of the cache's storage.
        self.cache, self.layer_idx = cache, layer_idx
        self.is_initialized = True

    @property
    def keys(self) -> torch.Tensor:
        """`[B, Hkv, C, Dk]` this layer's key slots."""
        group, a = self.cache._attn_index[self.layer_idx]
        return self.cache._groups[group].keys[a]

    @property
    def values(self) -> torch.Tensor:
        """`[B, Hkv, C, Dv]` this layer's value slots."""
        group, a = self.cache._attn_index[self.layer_idx]
        return self.cache._groups[group].values[a]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the cache allocates its storage up front."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self.cache.update(key_states, value_states, self.layer_idx)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.get_mask_sizes(query_length, self.layer_idx)

    def get_seq_length(self) -> int:
        return self.cache.get_seq_length(self.layer_idx)

    def get_max_length(self) -> int:
        return self.cache.get_max_length()


class BoleIndexedAttentionLayer(BoleAttentionLayer):
    """An "indexed_attention" layer of a `BoleCache` (Qwen4-Exp): KV, and the QSA indexer's keys and the slots'
    positions, which transformers' `DynamicIndexedLayer` keeps as `indexer_keys` and `indexer_position_ids`."""

    @property
    def indexer_position_ids(self) -> torch.Tensor | None:
        return self.cache.indexer_position_ids()

    @indexer_position_ids.setter
    def indexer_position_ids(self, position_ids: torch.Tensor) -> None:
        self.cache.record_indexer_positions(position_ids)


def _write_tree_kv_eager(
    keys: torch.Tensor,
    values: torch.Tensor,
    layer: int,
    slots: torch.Tensor,
    key_states: torch.Tensor,
    value_states: torch.Tensor,
) -> None:
    """Writes node i of row b (`key_states [B, Hkv, N, Dk]`, `value_states [B, Hkv, N, Dv]`) to slot `slots[b, i]` of
    attention layer `layer` of the stacked `keys [NA, B, Hkv, C, Dk]` and `values [NA, B, Hkv, C, Dv]`, in place."""
    index = slots[:, None, :, None]  # [B, 1, N, 1]
    keys[layer].scatter_(2, index.expand(key_states.shape), key_states)
    values[layer].scatter_(2, index.expand(value_states.shape), value_states)


# The same write as one op that mutates its arguments, for a compiled verify forward. Traced as `scatter_` into a view
# of the stacked storage that attention then reads, the write became an out-of-place scatter (a copy of the layer's
# whole storage) and a copy of the stack back at the end of the graph (inductor's code for a tiny model; copies of
# tens of microseconds a round on a 9B model). Inductor calls a mutating
# custom op in place. The op takes the whole stack and the layer's index, not the layer's view: in the graph compiled
# with the capacity symbolic (after a second prompt length), inductor handed the op every layer's view at storage
# offset 0, the first layer's, instead of its symbolic offset, so all tree KV landed in the first attention layer
# (house-model logits off by 1-2; torch 2.11 and 2.13). The cause looks like pytorch/pytorch#198068
# (no inductor lowering for aten.sym_storage_offset, reported there for AOTInductor; fix proposed in #198069).
_write_tree_kv = torch.library.custom_op("hf_bole::write_tree_kv", mutates_args=("keys", "values"))(
    _write_tree_kv_eager
)


class BoleLinearAttentionLayer(LinearAttentionCacheLayerMixin):
    """A GDN layer of a `BoleCache`: views into the cache's stacked conv windows and recurrent states."""

    is_croppable = False

    def __init__(self, cache: BoleCache, layer_idx: int):
        self.cache, self.layer_idx = cache, layer_idx
        self.number_of_states = 1

    @property
    def record_past(self) -> bool:
        """transformers 5.17 reads this attribute where later versions call `cache.is_recording_past`."""
        return self.cache.is_recording_past(self.layer_idx)

    @property
    def conv_states(self) -> dict[int, torch.Tensor]:
        group, g = self.cache._gdn_place[self.layer_idx]
        return {0: self.cache._groups[group].conv[g]}

    @property
    def recurrent_states(self) -> dict[int, torch.Tensor]:
        group, g = self.cache._gdn_place[self.layer_idx]
        return {0: self.cache._groups[group].recurrent[g]}

    @property
    def has_previous_state(self) -> dict[int, bool]:
        return {0: self.cache.has_previous_state(self.layer_idx)}

    def lazy_initialization(self, conv_states=None, recurrent_states=None, state_idx: int = 0, **kwargs) -> None:
        """Nothing to do: the cache allocates its storage up front."""

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        return self.cache.update_conv_state(conv_states, self.layer_idx, state_idx, **kwargs)

    def update_recurrent_state(self, recurrent_states, state_idx: int = 0, **kwargs) -> torch.Tensor:
        return self.cache.update_recurrent_state(recurrent_states, self.layer_idx, state_idx, **kwargs)


class BoleCache(Cache):
    """
    A transformers `Cache` for hybrid models (Gated DeltaNet + attention: Qwen3.5 and the other families of
    `hf_bole.models.family`) that verifies a whole draft tree in one forward and commits only each row's accepted
    path.

    Plain forwards (prefill, one-token decode, `model.generate`) behave exactly as with transformers' own
    caches. `hf_bole.models.tree_forward` runs the model over a tree of candidate tokens per row without
    changing the committed state, and `commit(tree_round, path)` then appends each row's accepted root-to-leaf path.
    Rows advance independently: each keeps its own length, left padding and next position.

    Args:
        config (`PreTrainedConfig`):
            The model config: the text config of a supported family (`hf_bole.models.family`), or the composite
            config of a `...ForConditionalGeneration` model (its text config is used).
        batch_size (`int`):
            Number of rows.
        max_cache_len (`int`, *optional*):
            KV slots per row, allocated once (the addresses then never change, as CUDA graphs need). A tree
            round needs `N` free slots after the longest row. `None` grows the storage on demand instead.
        device (`torch.device` or `str`, *optional*):
            Where the cache lives: the model's device. Defaults to torch's default device, as tensor factories do
            (or, with `layer_devices`, to the first layer's device). With `layer_devices`, where the bookkeeping
            (lengths, positions, padding, the tree's mask) lives.
        dtype (`torch.dtype`, *optional*):
            Dtype of the KV and conv windows, which must be the model's dtype; defaults to `config.dtype`.
            Recurrent states are always float32.
        layer_devices (sequence of `torch.device`, *optional*):
            For a model spread over devices (accelerate's `device_map`): the device each decoder layer runs on, where
            its state is kept (`BoleCache.for_model` reads them from the model). `None`: every layer on `device`.
        key_value_heads (`int`, *optional*):
            The KV heads each full-attention layer stores: a tensor-parallel rank's share of them (transformers'
            `tp_plan`; `BoleCache.for_model` reads it from the model's sharded weights). Defaults to the config's.

    Attributes:
        lengths (`torch.LongTensor` of shape `(batch_size,)`):
            Committed tokens per row, left padding included: the length the row has in a left-padded batch of
            sequences (as in `generate`'s `input_ids`), without the pending root token.
        positions (`torch.LongTensor` of shape `(batch_size,)`):
            The position id the next token of each row gets. Read from the position ids of plain forwards
            (`generate` numbers real tokens from 0, so there `positions = lengths - left padding`; a plain
            call without position ids numbers slots, so `positions = lengths`), advanced by `commit`.
        token_ids (`torch.LongTensor` of shape `(batch_size, length)`, *optional*):
            The tokens the rows hold, where known: set by the hf_bole call that returns the cache, so that a call
            continuing from it can check its `input_ids` start with them; `None` again once anything changes the
            cache.

    Example:

    ```python
    >>> cache = BoleCache(model.config, batch_size=2, device=model.device, dtype=model.dtype)
    >>> out = model(input_ids, attention_mask=attention_mask, past_key_values=cache)  # prefill
    >>> out = tree_forward(model, cache, tree_ids, parents)  # verify a tree per row
    >>> cache.commit(out.tree_round, path)  # keep each row's accepted path, e.g. path = [[0, 2, 5], [0, -1, -1]]
    ```
    """

    def __init__(
        self,
        config,
        batch_size: int,
        max_cache_len: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        layer_devices: Sequence[torch.device | str] | None = None,
        key_value_heads: int | None = None,
    ):
        config = config.get_text_config(decoder=True)
        layer_types = list(getattr(config, "layer_types", None) or [])
        attn_layers = [i for i, t in enumerate(layer_types) if t in ATTENTION_LAYER_TYPES]
        # GLM-5-Next's "shared" indexed layers reuse the previous layer's choice of keys: no indexer state of their own
        own_indexer = [kind != "shared" for kind in getattr(config, "indexer_types", None) or [None] * len(layer_types)]
        indexed_layers = [i for i, t in enumerate(layer_types) if t == INDEXED_LAYER and own_indexer[i]]
        gdn_layers = [i for i, t in enumerate(layer_types) if t == "linear_attention"]
        if not attn_layers or not gdn_layers or len(attn_layers) + len(gdn_layers) != len(layer_types):
            raise ValueError(
                f"BoleCache needs the config of a hybrid model whose layers are 'linear_attention' (GDN) or attention "
                f"{ATTENTION_LAYER_TYPES}, with at least one of each (Qwen3_5ForCausalLM and the other classes of "
                f"`hf_bole.models.family`); got {type(config).__name__} with layer_types={layer_types}"
            )
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if max_cache_len is not None and max_cache_len < 1:
            raise ValueError(f"max_cache_len must be positive or None, got {max_cache_len}")
        if dtype is None:
            dtype = config.dtype if isinstance(getattr(config, "dtype", None), torch.dtype) else torch.float32
        if layer_devices is not None and len(layer_devices) != len(layer_types):
            raise ValueError(
                f"layer_devices names a device per decoder layer: {len(layer_types)} of them, got {len(layer_devices)}"
            )
        if device is None:
            device = torch.get_default_device() if layer_devices is None else layer_devices[0]
        device = torch.device(device)
        if layer_devices is None:
            layer_devices = [device] * len(layer_types)
        else:
            layer_devices = [torch.device(d) for d in layer_devices]

        kinds = dict.fromkeys(ATTENTION_LAYER_TYPES, BoleAttentionLayer) | {INDEXED_LAYER: BoleIndexedAttentionLayer}
        layers = [kinds.get(t, BoleLinearAttentionLayer)(self, i) for i, t in enumerate(layer_types)]
        super().__init__(layers=layers)
        self._max_cache_len = max_cache_len
        self.dtype, self.device = dtype, device
        self._batch_size = batch_size
        # Layers grouped by device, in the order the forward meets the devices: layer -> (group, index in group).
        devices = list(dict.fromkeys(layer_devices))
        grouped = lambda layers: [[i for i in layers if layer_devices[i] == d] for d in devices]  # noqa: E731
        attn_groups, gdn_groups, index_groups = grouped(attn_layers), grouped(gdn_layers), grouped(indexed_layers)
        self._attn_index = {layer: (d, a) for d, group in enumerate(attn_groups) for a, layer in enumerate(group)}
        self._index_place = {layer: (d, i) for d, group in enumerate(index_groups) for i, layer in enumerate(group)}
        self._gdn_place = {layer: (d, g) for d, group in enumerate(gdn_groups) for g, layer in enumerate(group)}
        self._last_attn_layer = attn_layers[-1]

        layout = state_layout(config)
        if key_value_heads is not None:  # a rank's share of the KV heads under tensor parallelism
            layout = replace(layout, kv_heads=key_value_heads)
        ple_groups = grouped(layout.ple_layers)
        self._ple_place = {layer: (d, p) for d, group in enumerate(ple_groups) for p, layer in enumerate(group)}
        self.layout = layout
        self._conv_dim = layout.conv_dim

        capacity, B = max_cache_len or 0, batch_size
        Hkv, hv, k, v = layout.kv_heads, layout.linear_value_heads, layout.linear_key_dim, layout.linear_value_dim
        self._groups = []
        for d, attn, gdn, indexed, ple in zip(devices, attn_groups, gdn_groups, index_groups, ple_groups):
            kv = dict(dtype=dtype, device=d)
            self._groups.append(
                _DeviceGroup(
                    device=d,
                    keys=torch.zeros(len(attn), B, Hkv, capacity, layout.key_dim, **kv),
                    values=torch.zeros(len(attn), B, Hkv, capacity, layout.value_dim, **kv),
                    conv=torch.zeros(len(gdn), B, layout.conv_dim, layout.conv_width, **kv),
                    recurrent=torch.zeros(len(gdn), B, hv, k, v, dtype=torch.float32, device=d),
                    index_keys=torch.zeros(len(indexed), B, capacity, layout.index_key_dim, **kv),
                    ple_conv=torch.zeros(len(ple), B, layout.ple_dim, layout.ple_conv_width, **kv),
                    ple_tokens=torch.full(
                        (len(ple), B, 1, layout.ple_context), layout.ple_fill, dtype=torch.int64, device=d
                    ),
                )
            )
        self.lengths = torch.zeros(B, dtype=torch.int64, device=device)
        self.positions = torch.zeros(B, dtype=torch.int64, device=device)
        self._valid = torch.ones(B, capacity, dtype=torch.bool, device=device)
        self._slot_positions = (
            torch.zeros(B, capacity, dtype=torch.int64, device=device)
            if indexed_layers and layout.index_positions
            else None
        )
        self.device = self.lengths.device  # with its index: "cuda" becomes "cuda:0"

        # Host-side bookkeeping, so that the hot path never reads a length back from the device.
        self._aligned_length: int | None = 0  # the common length while all rows are known to be equal
        self._length_bound = 0  # an upper bound on max(lengths)
        self._observed = False  # the current plain forward's positions and padding were recorded
        self._gdn_started = dict.fromkeys(gdn_layers, False)  # GDN layer -> its state was written
        # Counts the committed states this cache has held (every commit, plain forward and reset moves it on): a round
        # commits only onto the state it verified from (`TreeRound.verified_from`).
        self._state = 0
        self._tree: TreeRound | None = None  # the round a verify forward under way fills (`tree_mode`), else None
        self.token_ids: torch.Tensor | None = None

    @classmethod
    def for_model(cls, model, batch_size: int, max_cache_len: int | None = None) -> BoleCache:
        """A cache for `model` in its dtype, each layer's state on the device that layer runs on (one device, or
        several under accelerate's `device_map`), the bookkeeping on the first layer's; of a tensor-parallel model,
        the KV heads of this rank."""
        return cls(
            model.config, batch_size, max_cache_len=max_cache_len, dtype=model.dtype,
            layer_devices=placement(model).layer_devices, key_value_heads=tensor_parallel(model).key_value_heads,
        )  # fmt: skip

    def __repr__(self) -> str:
        devices = f", devices={[str(g.device) for g in self._groups]}" if len(self._groups) > 1 else ""
        return (
            f"BoleCache(batch_size={self._batch_size}, capacity={self.capacity}, "
            f"attention_layers={len(self._attn_index)}, gdn_layers={len(self._gdn_place)}, dtype={self.dtype}{devices})"
        )

    @property
    def devices(self) -> list[torch.device]:
        """The devices the layers' state is kept on, in layer order (one for a model on one device)."""
        return [g.device for g in self._groups]

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def capacity(self) -> int:
        """KV slots per row currently allocated."""
        return self._valid.shape[1]

    @property
    def valid(self) -> torch.Tensor:
        """`[B, capacity]` bool: False at the slots of left padding (and of padding tokens a plain forward
        appended), which no query attends to."""
        return self._valid

    @property
    def is_compileable(self) -> bool:
        # `generate` would auto-compile its decode step around this cache, whose length bookkeeping is on the
        # host; the decoding loop captures its own CUDA graphs instead.
        return False

    @property
    def is_croppable(self) -> bool:
        return False

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Writes the new keys/values of full-attention layer `layer_idx` and returns the layer's KV.

        Plain forward: appends `q` tokens to every row and returns `[B, Hkv, lengths + q, D]`. Tree mode:
        writes node i of row b to slot `lengths[b] + i` and returns the whole storage `[B, Hkv, C, D]`, to be
        read with the ancestor mask of `tree_mode`. (D: Dk for keys, Dv for values; MLA's latent and rotary key.)
        """
        group, a = self._attention_index(layer_idx)
        keys, values = self._groups[group].keys, self._groups[group].values
        self._check_input(key_states, "key_states", layer_idx, group)
        if key_states.dtype != self.dtype:
            raise ValueError(
                f"BoleCache was created with dtype={self.dtype} but the model runs in {key_states.dtype}; "
                f"create it with dtype=model.dtype"
            )
        r = self._tree
        if r is not None:
            write = _write_tree_kv if torch.compiler.is_compiling() else _write_tree_kv_eager
            write(keys, values, a, r.groups[group].slots, key_states, value_states)
            return keys[a], values[a]

        start, q = self._plain_length(), key_states.shape[2]
        self._ensure_capacity(start + q)
        keys, values = self._groups[group].keys, self._groups[group].values  # growth replaces the storage
        keys[a, :, :, start : start + q].copy_(key_states)
        values[a, :, :, start : start + q].copy_(value_states)
        if layer_idx == self._last_attn_layer:
            self._finish_plain_forward(start + q, q)
        return keys[a, :, :, : start + q], values[a, :, :, : start + q]

    def update_indexer(self, index_keys: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """Writes the new QSA indexer keys `[B, q, Dx]` of indexed layer `layer_idx` and returns the layer's, slot by
        slot as `update` returns its KV: `[B, lengths + q, Dx]` after a plain forward's, the whole storage `[B, C, Dx]`
        in tree mode (node i of row b at slot `lengths[b] + i`), read where the layer's mask says."""
        if layer_idx not in self._index_place:
            raise ValueError(f"layer {layer_idx} is not an indexed attention layer of this BoleCache")
        group, i = self._index_place[layer_idx]
        self._check_input(index_keys, "index_keys", layer_idx, group)
        stored = self._groups[group].index_keys
        r = self._tree
        if r is not None:
            slots = r.groups[group].slots[..., None].expand(index_keys.shape)  # [B, N, Dx]
            stored[i].scatter_(1, slots, index_keys.to(stored.dtype))
            return stored[i]
        start, q = self._plain_length(), index_keys.shape[1]
        self._ensure_capacity(start + q)
        stored = self._groups[group].index_keys  # growth replaces the storage
        stored[i, :, start : start + q].copy_(index_keys)
        return stored[i, :, : start + q]

    def indexer_position_ids(self) -> torch.Tensor | None:
        """`[3, B, S]` the position ids of the slots (in the three rotary rows Qwen4-Exp's indexer rotates by; text
        positions in all three), which the model puts before the forward's own so that slot s's is at index s: the
        committed slots in a plain forward (None before the first), the whole storage in tree mode, where `tree_mode`
        has written the nodes' at their slots and the forward's own are the nodes' again, at the end."""
        if self._tree_active():
            return self._slot_positions[None].expand(3, -1, -1)
        length = self._plain_length()
        return self._slot_positions[None, :, :length].expand(3, -1, -1) if length else None

    def record_indexer_positions(self, position_ids: torch.Tensor) -> None:
        """Takes what the model keeps as the indexer's positions after `indexer_position_ids`: `[3, B, S + q]`, the
        slots' and then a plain forward's q new ones, which go to the q slots after the committed ones (a tree's were
        written by `tree_mode`)."""
        if self._tree_active():
            return
        start = self._plain_length()
        end = position_ids.shape[-1]
        self._ensure_capacity(end)
        self._slot_positions[:, start:end].copy_(position_ids[0, :, start:])

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The common length of all rows (left padding included). Rows that accepted different numbers of
        tokens have no common length: their maximum is returned then (one read from the device)."""
        if self._aligned_length is None and not self._check_aligned():
            return int(self.lengths.max())
        return self._aligned_length

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self._plain_length() + query_length, 0

    @property
    def max_cache_len(self) -> int | None:
        """The slot limit given at construction (None: grown as needed). A property because transformers 5.17's
        `Cache` declares a read-only one."""
        return self._max_cache_len

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1 if self.max_cache_len is None else self.max_cache_len

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """`[B, D, W]` the committed conv window of GDN layer `layer_idx`, or None before its first forward.
        In tree mode always the window (zeros on a fresh cache): the tree conv falls back to it above the root.
        A per-layer embedding's windows (`state_idx` 1: its conv's `[B, Dp, Sp]`, 2: its n-gram tokens `[B, Sn]`)
        always, from their fill (zeros, eos) on."""
        if state_idx != 0:
            stored, _ = self._ple_window(layer_idx, state_idx)
            return stored if state_idx == 1 else stored[:, 0]
        group, g = self._gdn(layer_idx)
        if self._gdn_started[layer_idx] or self._tree_active():
            return self._groups[group].conv[g]
        return None

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """`[B, H, K, V]` float32 committed state of GDN layer `layer_idx`, or None before its first forward.
        In tree mode always the state, which the verification starts from and does not change."""
        group, g = self._gdn(layer_idx)
        if self._gdn_started[layer_idx] or self._tree_active():
            return self._groups[group].recurrent[g]
        return None

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        """Whether GDN layer `layer_idx` has a state to start from: after its first forward, and in tree mode always
        (zeros on a fresh cache). transformers 5.17 passes the state to the recurrence only when this says so; a
        CUDA graph captured on a fresh cache (the first prefill chain) would otherwise start every replay from zeros."""
        if layer_idx is None:
            layer_idx = max(self._gdn_place)
        self._gdn(layer_idx)
        return self._gdn_started[layer_idx] or self._tree_active()

    def is_recording_past(self, layer_idx: int) -> bool:
        # In tree mode the one-token fast path (which updates the conv window in place) must not run, even for
        # a one-node tree: answering True sends the GDN layer through `update_conv_state` and the conv seam.
        return self._tree_active()

    def update_conv_state(
        self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs
    ) -> torch.Tensor:
        """Takes the new pre-conv inputs `[B, D, q]` of GDN layer `layer_idx` and returns the conv's input:
        the committed window followed by them (just them at the first forward).

        Plain forward: the window becomes the last W inputs. Tree mode: the inputs are kept for `commit` and
        the window is left as it is. A per-layer embedding's windows (`state_idx` 1: its conv's inputs `[B, Dp, q]`,
        2: its tokens `[B, q]`) the same way, the window always in front (it starts as what upstream pads with).
        """
        if state_idx != 0:
            return self._update_ple_window(conv_states, layer_idx, state_idx)
        group, g = self._gdn(layer_idx)
        conv = self._groups[group].conv
        self._check_input(conv_states, "conv_states", layer_idx, group)
        r = self._tree
        width = conv.shape[-1]
        if r is not None:
            r.groups[group].conv_io[g].copy_(conv_states.transpose(1, 2))  # [B, N, D], for `commit`
            # The conv's input as upstream's cat makes it, not a view of conv_io: under torch.compile a custom op
            # reading a view of one layer of a stacked buffer that later layers write made inductor copy the
            # whole buffer around each conv (two copies of 9 us a GDN layer on the 9B shape on an H200).
            return torch.cat([conv[g], conv_states.to(conv.dtype)], dim=-1)  # [B, D, W + N]
        if not self._gdn_started[layer_idx]:  # first forward: a shorter input leaves zeros in front, as upstream pads
            self._gdn_started[layer_idx] = True
            tail = conv_states[..., -width:]
            conv[g].zero_()
            conv[g, ..., width - tail.shape[-1] :].copy_(tail)
            return conv_states
        full = torch.cat([conv[g], conv_states.to(conv.dtype)], dim=-1)
        conv[g].copy_(full[..., -width:])
        return full

    def _ple_window(self, layer_idx: int, state_idx: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-layer embedding window `state_idx` (1: conv, 2: tokens) of layer `layer_idx` as `[B, D, W]`, and, in
        tree mode, the round's `[B, N, D]` inputs of it."""
        if layer_idx not in self._ple_place or state_idx not in (1, 2):
            raise ValueError(
                f"layer {layer_idx} asks for conv state {state_idx}, but BoleCache keeps conv states 1 and 2 only for "
                f"the per-layer embeddings of this model's layers {sorted(self._ple_place)} (`ple_layer_ids` less one)"
            )
        group, p = self._ple_place[layer_idx]
        stored = (self._groups[group].ple_conv if state_idx == 1 else self._groups[group].ple_tokens)[p]
        r = self._tree
        if r is None:
            return stored, None
        return stored, (r.groups[group].ple_io if state_idx == 1 else r.groups[group].ple_token_io)[p]

    def _update_ple_window(self, x: torch.Tensor, layer_idx: int, state_idx: int) -> torch.Tensor:
        """`update_conv_state` of a per-layer embedding's window: returns the window followed by `x` (`[B, Dp, q]`
        conv inputs, or `[B, q]` tokens as `[B, Sn + q]`)."""
        stored, io = self._ple_window(layer_idx, state_idx)
        self._check_input(x, "conv_states", layer_idx, self._ple_place[layer_idx][0])
        x = x if state_idx == 1 else x[:, None]  # [B, D, q]
        full = torch.cat([stored, x.to(stored.dtype)], dim=-1)
        if io is not None:
            io.copy_(x.transpose(1, 2))  # [B, N, D], for `commit`
        else:
            stored.copy_(full[..., -stored.shape[-1] :])
        return full if state_idx == 1 else full[:, 0]

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor | GDNTreeState, layer_idx: int, state_idx: int = 0, **kwargs
    ) -> torch.Tensor:
        """Plain forward: stores the new state `[B, H, K, V]` of GDN layer `layer_idx`. Tree mode: takes the
        layer's `GDNTreeState` (factors or snapshots) for `commit`; the committed state is left as it is."""
        group, g = self._gdn(layer_idx)
        recurrent = self._groups[group].recurrent
        r = self._tree
        if r is not None:
            if not isinstance(recurrent_states, GDNTreeState):
                raise RuntimeError(
                    "a GDN layer reached the cache in tree mode without going through the tree verification: the "
                    "hf_bole adapter is not wired into this model (call hf_bole.models.tree_forward)"
                )
            r.use_qk_l2norm = recurrent_states.use_qk_l2norm
            rg = r.groups[group]
            if r.verify == "serial":
                rg.snapshots[g] = recurrent_states.snapshots
            else:
                rg.keys[g].copy_(recurrent_states.key)
                rg.u[g].copy_(recurrent_states.u)
                if rg.g is not None:
                    rg.g[g].copy_(recurrent_states.g)
                else:
                    rg.log_decay[g].copy_(recurrent_states.log_decay)
            return recurrent[g]
        recurrent[g].copy_(recurrent_states)
        return recurrent[g]

    def record_plain_inputs(
        self, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None, num_tokens: int
    ) -> None:
        """Called by the model adapter at the start of every plain forward through this cache, with the
        forward's 2D attention mask `[B, past + q]` (or None) and text position ids `[B, q]` (or None).

        Records which of the `q = num_tokens` new slots are padding and the position the next token will get,
        which tree rounds need (their masks skip padding, their positions continue the row's numbering).
        """
        start = self._plain_length()
        self._ensure_capacity(start + num_tokens)
        if attention_mask is not None and attention_mask.dim() == 2:
            self._check_batch(attention_mask.shape[0], "attention_mask")
            self._valid[:, start : start + num_tokens].copy_(attention_mask[:, -num_tokens:].bool())
        if position_ids is not None:
            self.positions.copy_(position_ids[:, -1].expand(self._batch_size) + 1)
            self._observed = True

    def _finish_plain_forward(self, new_length: int, num_tokens: int) -> None:
        self.lengths.add_(num_tokens)
        if not self._observed:
            self.positions.add_(num_tokens)
        self._observed = False
        self._aligned_length = self._length_bound = new_length
        self._advance()  # written over the tree's slots: no round verified before commits now

    def new_round(self, parents: torch.Tensor, verify: str = "closed_form") -> TreeRound:
        """Buffers for a verify forward of trees `parents [B, N]` (on the cache's device) in `verify` mode, to pass
        to `tree_mode` (and `hf_bole.models.tree_forward`), which fill them, and then to `commit`."""
        B, N = parents.shape
        layout = self.layout
        hk, k = layout.linear_key_heads, layout.linear_key_dim
        hv, v = layout.linear_value_heads, layout.linear_value_dim
        closed = verify == "closed_form"
        groups = []
        for group in self._groups:
            NG, _, D, _ = group.conv.shape
            NP, _, Dp, _ = group.ple_conv.shape
            d = group.device
            f32 = dict(dtype=torch.float32, device=d)
            groups.append(
                _GroupRound(
                    slots=None,
                    conv_io=torch.empty(NG, B, N, D, dtype=self.dtype, device=d),
                    keys=torch.empty(NG, B, N, hk, k, dtype=self.dtype, device=d) if closed else None,
                    u=torch.empty(NG, B, N, hv, v, **f32) if closed else None,
                    log_decay=torch.empty(NG, B, N, hv, **f32) if closed and not layout.per_key_decay else None,
                    g=torch.empty(NG, B, N, hv, k, **f32) if closed and layout.per_key_decay else None,
                    snapshots=[None] * NG,
                    ple_io=torch.empty(NP, B, N, Dp, dtype=self.dtype, device=d),
                    ple_token_io=torch.empty(NP, B, N, 1, dtype=torch.int64, device=d),
                )
            )
        NA = len(self._attn_index)
        tree_kv_bytes = NA * B * layout.kv_heads * N * (layout.key_dim + layout.value_dim) * self.dtype.itemsize
        return TreeRound(parents=parents, verify=verify, groups=groups, tree_kv_bytes=tree_kv_bytes)

    def round_for(self, parents: torch.Tensor, verify: str, tree_round: TreeRound | None = None) -> TreeRound:
        """`tree_round` when its buffers fit trees `parents [B, N]` in `verify` mode (a later round of the same
        shape), else `new_round`'s."""
        if tree_round is None or tree_round.parents.shape != parents.shape or tree_round.verify != verify:
            return self.new_round(parents, verify)
        return tree_round

    @contextlib.contextmanager
    def tree_mode(
        self, parents: torch.Tensor, tree_round: TreeRound
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Routes this cache into tree mode for one verification forward, whose tree state goes to `tree_round`.

        Args:
            parents (`torch.LongTensor` of shape `(batch_size, N)`):
                Parent of every node, `-1 <= parents[b, i] < i`; node 0 is the row's root (parent -1), padding
                nodes of a ragged batch also have parent -1.
            tree_round (`TreeRound`): buffers for trees of this shape (`new_round`, `round_for`), in the verify mode
                the forward runs: "closed_form" keeps GDN factors, "serial" per-node state snapshots.

        Yields (made by `tree_masks`, one Triton launch on CUDA):
            attention_mask (`torch.BoolTensor` of shape `(batch_size, 1, N, capacity)`): node i of row b sees the
                row's committed, non-padding slots, its tree ancestors and itself.
            position_ids (`torch.LongTensor` of shape `(batch_size, N)`): `positions[b] + depth(i)`.
            ancestors (`torch.BoolTensor` of shape `(batch_size, N, N)`): `tree_ancestor_mask(parents)`, for the
                layers' tree kernels.
        """
        if tree_round.verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {VERIFY_MODES}, got {tree_round.verify!r}")
        if parents.dim() != 2:
            raise ValueError(f"parents must be [B, N], got shape {tuple(parents.shape)}")
        B, N = parents.shape
        self._check_batch(B, "parents")
        check_parents(parents, B, N)
        if parents.device != self.device:
            raise ValueError(f"parents are on {parents.device} but the cache is on {self.device}")
        if tree_round.parents.shape != parents.shape:
            raise ValueError(
                f"the TreeRound holds trees of shape {list(tree_round.parents.shape)}, not {list(parents.shape)}: make "
                f"one with BoleCache.new_round(parents)"
            )
        self._reserve_tree(N)

        tree_round.parents = parents
        slots = self.lengths[:, None] + torch.arange(N, device=self.device)
        for group, rg in zip(self._groups, tree_round.groups):
            rg.slots = slots.to(group.device)  # one copy per device group and round (none on the cache's device)
        ancestors, position_ids, attention_mask = tree_masks(parents, self.lengths, self.positions, self._valid)
        if self._slot_positions is not None:  # the indexer rotates a block's pooled key by its first slot's position
            self._slot_positions.scatter_(1, slots, position_ids)

        self._tree = tree_round
        try:
            yield attention_mask, position_ids, ancestors
        finally:
            self._tree = None
        self.mark_verified(tree_round)

    def mark_verified(self, tree_round: TreeRound) -> None:
        """Records that `tree_round` holds a verify forward from the current committed state, which `commit` checks:
        `tree_mode` ends with it, and a CUDA-graph replay of a verify forward, which runs no Python, is followed by
        it (`hf_bole.generation.verify.VerifyGraphs`)."""
        tree_round.verified_from = self._state

    def commit(self, tree_round: TreeRound, path: torch.Tensor, check_values: bool = True) -> None:
        """Appends each row's accepted path of a verified tree round to the committed state.

        Args:
            tree_round (`TreeRound`):
                What the verify forward left (`TreeForwardOutput.tree_round`), from the cache's current state: once
                per forward, and no plain forward in between.
            path (`torch.LongTensor` of shape `(batch_size, L)`):
                Node indices root-to-leaf (starting with 0, the root), right-padded with -1, L <= N. A row of
                only -1 commits nothing.
            check_values (`bool`, *optional*, defaults to `True`):
                Check that every path is a root-to-node chain of the tree (reads `path` on the host). The decoding
                loop passes False: its paths come from the acceptance walk, and the reads would make the host wait
                for the verify forward before it can queue the commit.

        Moves the path's KV into slots `lengths[b] + j`, sets every GDN state to the state after the path (one
        stacked `tree_gdn_commit`, or the leaf's snapshot in serial mode) and every conv window to the last W
        pre-conv inputs, and advances `lengths` and `positions` by the path's length.
        """
        r = tree_round
        if not isinstance(r, TreeRound) or r.verified_from != self._state:
            raise ValueError(
                "commit(tree_round, path) needs the round of a tree_forward from the cache's current state: call "
                "tree_forward first (once per commit)"
            )
        B, N = r.parents.shape
        check_path(path, B, N, check_values=check_values)
        L = path.shape[1]
        if L > N:
            raise ValueError(f"path holds at most N = {N} nodes (the tree's size), got L = {L}")
        if path.device != self.device:
            raise ValueError(f"path is on {path.device} but the cache is on {self.device}")
        check_values = check_values and not is_capturing(path)
        if check_values and bool(((path[:, 0] != 0) & (path[:, 0] != -1)).any()):
            raise ValueError(
                f"every path starts at the root, node 0 (or is all -1), got path[:, 0] = {path[:, 0].tolist()}"
            )
        # A path need only be increasing for check_path; it must also follow parent links.
        if check_values:
            prev = torch.cat([torch.full_like(path[:, :1], -1), path[:, :-1]], dim=1)
            linked = r.parents.gather(1, path.clamp(min=0)) == prev
            if bool(((path >= 0) & ~linked).any()):
                raise ValueError(
                    f"path must follow parent links from the root, got {path.tolist()} for parents {r.parents.tolist()}"
                )

        accepted = path >= 0  # [B, L]
        for group, rg in zip(self._groups, r.groups):
            # One copy of the path and lengths per device group (none on the cache's own device).
            self._commit_group(group, rg, r, *(x.to(group.device) for x in (path, self.lengths)), check_values)
        if self._slot_positions is not None:
            commit_slots_torch(self.lengths, path, self._slot_positions[None, :, None, :, None])  # [1, B, 1, C, 1]

        num_accepted = accepted.sum(1)
        self.lengths.add_(num_accepted)
        self.positions.add_(num_accepted)
        self.record_commit(L)

    def record_commit(self, width: int) -> None:
        """The host-side record of a commit of paths `width` columns wide: `commit` ends with it, and a CUDA-graph
        replay of a commit (`hf_bole.generation.commit`), which runs no Python, is followed by it."""
        self._length_bound += width
        self._aligned_length = None
        self._gdn_started = dict.fromkeys(self._gdn_started, True)
        self._advance()

    def _advance(self) -> None:
        """Records that the committed state changed: a round verified before can no longer commit onto it, and the
        recorded token ids no longer say what it holds."""
        self._state += 1
        self.token_ids = None

    @staticmethod
    def _commit_group(
        group: _DeviceGroup,
        rg: _GroupRound,
        r: TreeRound,
        path: torch.Tensor,
        lengths: torch.Tensor,
        check_values: bool,
    ) -> None:
        """`commit` for the layers of one device group: `path [B, L]` and the committed `lengths [B]` before it, on
        its device."""
        B = path.shape[0]
        N = r.parents.shape[1]
        kv_commit(group.keys, group.values, lengths, path)
        if group.index_keys.shape[0] > 0:
            commit_slots_torch(lengths, path, group.index_keys[:, :, None])  # [NI, B, 1, C, Dx]

        if r.verify == "serial":
            for g, snapshots in enumerate(rg.snapshots):
                group.recurrent[g].copy_(
                    tree_gdn_commit_serial(group.recurrent[g], snapshots, path, check_values=check_values)
                )
        elif group.recurrent.shape[0] > 0 and rg.g is not None:
            tree_kda_commit(
                group.recurrent, rg.keys, rg.g, rg.u, path,
                use_qk_l2norm_in_kernel=r.use_qk_l2norm, out=group.recurrent, check_values=check_values,
            )  # fmt: skip
        elif group.recurrent.shape[0] > 0:
            tree_gdn_commit(
                group.recurrent, rg.keys, rg.u, rg.log_decay, path,
                use_qk_l2norm_in_kernel=r.use_qk_l2norm, out=group.recurrent, check_values=check_values,
            )  # fmt: skip
        windows = ((group.conv, rg.conv_io), (group.ple_conv, rg.ple_io), (group.ple_tokens, rg.ple_token_io))
        for stored, io in windows:  # [n, B, D, W] windows, [n, B, N, D] the nodes' inputs
            n, _, D, W = stored.shape
            if n > 0:
                stored = stored.view(n * B, D, W)
                tree_conv_state_commit(
                    stored, io.view(n * B, N, D), path.repeat(n, 1), out=stored, check_values=check_values
                )

    def _tree_active(self) -> bool:
        return self._tree is not None

    def _check_aligned(self) -> bool:
        """Reads the lengths back (once) to learn whether all rows are equally long again."""
        low, high = (int(x) for x in torch.aminmax(self.lengths))
        if low == high:
            self._aligned_length = self._length_bound = high
        return low == high

    def _plain_length(self) -> int:
        """The common length plain forwards append at; rows must be equally long."""
        if self._aligned_length is None and not self._check_aligned():
            raise ValueError(
                f"a plain forward appends the same tokens to all rows, but the rows of this BoleCache hold different "
                f"lengths {self.lengths.tolist()} after tree commits; continue with hf_bole.models.tree_forward "
                f"(a one-node tree is a one-token decode)"
            )
        return self._aligned_length

    def _reserve_tree(self, num_nodes: int) -> None:
        """Makes sure every row has `num_nodes` free slots, reading the lengths back only when the host-side
        bound says they might not fit."""
        if self._length_bound + num_nodes <= self.capacity:
            return
        if is_capturing(self.lengths):
            raise ValueError(
                f"a tree of {num_nodes} nodes may not fit after rows of up to {self._length_bound} tokens in "
                f"max_cache_len={self.capacity} slots, which cannot be checked during CUDA graph capture; create the "
                f"BoleCache with a larger max_cache_len"
            )
        self._length_bound = int(self.lengths.max())
        reason = f"a tree of {num_nodes} nodes after the longest row ({self._length_bound} tokens)"
        self._ensure_capacity(self._length_bound + num_nodes, reason)

    def reserve(self, slots: int) -> None:
        """Allocates `slots` KV slots per row now, so that forwards up to there need not grow the storage (a cache of
        `max_cache_len=None` grows on demand, doubling; a fixed one refuses more than it holds)."""
        self._ensure_capacity(slots, f"reserve({slots})")

    def pad(self, counts: torch.Tensor) -> None:
        """Appends `counts[b]` padding slots to row b (`counts`: `[B]`): slots no query attends to, which take no
        position. Prompts prefilled as chains skip their padding: padded first, every row ends where transformers'
        forward over the padded batch leaves it (one host read)."""
        counts = counts.to(self.device)
        most = int(counts.max())
        if most == 0:
            return
        self._ensure_capacity(self._length_bound + most)
        slots = torch.arange(self.capacity, device=self.device)
        self._valid &= ~((slots >= self.lengths[:, None]) & (slots < (self.lengths + counts)[:, None]))
        self.lengths.add_(counts)
        self._length_bound += most
        self._aligned_length = None
        self._advance()

    def state(self) -> CacheState:
        """The committed state of every row as a `CacheState`: views of the storage, no copies. The rows must be
        equally long (as they are after a plain forward, or when an hf_bole call returns the cache)."""
        if self._aligned_length is None and not self._check_aligned():
            raise ValueError(
                f"the rows of this BoleCache hold different numbers of tokens {self.lengths.tolist()} (tree commits "
                f"in the middle of decoding): only a cache whose rows are equally long can be continued or converted"
            )
        L = self._aligned_length
        if L == 0:
            return CacheState({}, {}, {}, {}, 0)
        keys, values, conv, recurrent = {}, {}, {}, {}
        for layer, (group, a) in self._attn_index.items():
            keys[layer] = self._groups[group].keys[a, :, :, :L]
            values[layer] = self._groups[group].values[a, :, :, :L]
        for layer, (group, g) in self._gdn_place.items():
            conv[layer], recurrent[layer] = self._groups[group].conv[g], self._groups[group].recurrent[g]
        index_keys = {layer: self._groups[g].index_keys[i, :, :L] for layer, (g, i) in self._index_place.items()}
        slot_positions = None if self._slot_positions is None else self._slot_positions[:, :L]
        ple_conv = {layer: self._groups[g].ple_conv[p] for layer, (g, p) in self._ple_place.items()}
        ple_tokens = {layer: self._groups[g].ple_tokens[p, :, 0] for layer, (g, p) in self._ple_place.items()}
        return CacheState(
            keys, values, conv, recurrent, L, valid=self._valid[:, :L], token_ids=self.token_ids,
            index_keys=index_keys, slot_positions=slot_positions, ple_conv=ple_conv, ple_tokens=ple_tokens,
        )  # fmt: skip

    def load(self, state: CacheState, starts: Sequence[int] | None = None, valid: torch.Tensor | None = None) -> None:
        """Makes the cache hold `state` and nothing else, copied into the storage (whose addresses stay put): each row
        the state's row, or, for a state of one row and a cache of several, that row in every one (a shared prefix).

        Args:
            state (`CacheState`): of this cache's batch size or of one row, from a cache of this model.
            starts (`Sequence[int]`, *optional*): per row, the slot the state's first one goes to, after as many
                slots of padding (a row's left padding before a shared prefix); 0 by default.
            valid (`torch.BoolTensor` of shape `(batch_size, L)`, *optional*): which of the state's slots hold tokens
                (attention skips the others); the state's own `valid` (all of them where it has none) by default.

        The rows then hold `starts[b] + L` slots, and each row's next position is the count of its valid slots (as
        `generate` numbers tokens).
        """
        B = self._batch_size
        if state.length > 0 and state.batch_size not in (1, B):
            raise ValueError(
                f"the cache holds {state.batch_size} rows, but this call has {B}: pass a cache of {B} rows, or of one "
                f"row (a prefix every row shares)"
            )
        self._check_state(state)
        starts = [0] * B if starts is None else [int(s) for s in starts]
        self.reset()
        L = state.length
        if L == 0:
            return
        self._ensure_capacity(max(starts) + L)
        if valid is None:
            valid = state.valid if state.valid is not None else torch.ones(1, L, dtype=torch.bool)
        valid = valid.to(self.device, torch.bool).expand(B, L)
        rows_from = {}  # first slot -> the rows whose state starts there
        for b, start in enumerate(starts):
            rows_from.setdefault(start, []).append(b)
        for layer, (group, a) in self._attn_index.items():
            for stored, given in ((self._groups[group].keys, state.keys), (self._groups[group].values, state.values)):
                source = given[layer].to(stored.device).expand(B, -1, -1, -1)  # [B, Hkv, L, Dh]
                for start, rows in rows_from.items():
                    if len(rows) == B:
                        stored[a, :, :, start : start + L].copy_(source)
                    else:
                        index = torch.tensor(rows, device=stored.device)
                        stored[a, index, :, start : start + L] = source[index]
        indexed = [(self._groups[g].index_keys[i], state.index_keys[n]) for n, (g, i) in self._index_place.items()]
        if self._slot_positions is not None:
            indexed.append((self._slot_positions[..., None], state.slot_positions[..., None]))
        for stored, given in indexed:  # [B, C, Dx] the slots of a layer's indexer keys, or of the positions
            source = given.to(stored.device).expand(B, -1, -1)  # [B, L, Dx]
            for start, rows in rows_from.items():
                index = torch.tensor(rows, device=stored.device)
                stored[index, start : start + L] = source[index]
        for layer, (group, g) in self._gdn_place.items():
            self._groups[group].conv[g].copy_(state.conv[layer].expand(B, -1, -1))
            self._groups[group].recurrent[g].copy_(state.recurrent[layer].expand(B, -1, -1, -1))
        for layer, (group, p) in self._ple_place.items():
            self._groups[group].ple_conv[p].copy_(state.ple_conv[layer].expand(B, -1, -1))
            self._groups[group].ple_tokens[p, :, 0].copy_(state.ple_tokens[layer].expand(B, -1))
        first = torch.tensor(starts, device=self.device)[:, None]  # [B, 1]
        slots = torch.arange(self.capacity, device=self.device)
        inside = valid.gather(1, (slots - first).clamp(0, L - 1))  # [B, C] the state's valid at its slots
        self._valid.copy_(torch.where(slots < first, False, torch.where(slots < first + L, inside, True)))
        self.lengths.copy_(first[:, 0] + L)
        self.positions.copy_(valid.sum(-1))
        self._aligned_length = starts[0] + L if len(rows_from) == 1 else None
        self._length_bound = max(starts) + L
        self._gdn_started = dict.fromkeys(self._gdn_started, True)
        self._advance()

    def _check_state(self, state: CacheState) -> None:
        """Raises a ValueError naming the first layer where `state` does not fit this cache's model."""
        if state.length == 0:
            return
        if set(state.index_keys) != set(self._index_place) or (state.slot_positions is None) != (
            self._slot_positions is None
        ):
            raise ValueError(
                f"the cache holds indexer states of layers {sorted(state.index_keys)}, but this model's indexed "
                f"attention layers with an indexer are {sorted(self._index_place)}: a cache of another model"
            )
        if set(state.keys) != set(self._attn_index) or set(state.conv) != set(self._gdn_place):
            raise ValueError(
                f"the cache holds attention layers {sorted(state.keys)} and GDN layers {sorted(state.conv)}, but this "
                f"model's are {sorted(self._attn_index)} and {sorted(self._gdn_place)}: a cache of another model"
            )
        if set(state.ple_conv) != set(self._ple_place) or set(state.ple_tokens) != set(self._ple_place):
            raise ValueError(
                f"the cache holds per-layer embedding windows of layers {sorted(state.ple_conv)}, but this model has "
                f"per-layer embeddings in layers {sorted(self._ple_place)}: a cache of another model"
            )
        layout = self.layout
        k, hv, v = layout.linear_key_dim, layout.linear_value_heads, layout.linear_value_dim
        width = self._groups[0].conv.shape[-1]
        keys, values = ((layout.kv_heads, state.length, dim) for dim in (layout.key_dim, layout.value_dim))
        expected = [(state.keys, keys, self.dtype), (state.values, values, self.dtype),
                    (state.conv, (self._conv_dim, width), self.dtype), (state.recurrent, (hv, k, v), None),
                    (state.index_keys, (state.length, layout.index_key_dim), self.dtype),
                    (state.ple_conv, (layout.ple_dim, layout.ple_conv_width), self.dtype),
                    (state.ple_tokens, (layout.ple_context,), torch.int64)]  # fmt: skip
        for tensors, shape, dtype in expected:
            for layer, t in tensors.items():
                if tuple(t.shape[1:]) != shape:
                    raise ValueError(
                        f"layer {layer} of the cache holds a state of shape {list(t.shape[1:])} per row, but this "
                        f"model's is {list(shape)}: a cache of another model"
                    )
                if dtype is not None and t.dtype != dtype:
                    raise ValueError(
                        f"layer {layer} of the cache holds {t.dtype}, but the model runs in {dtype}: continue from a "
                        f"cache the model made in its dtype"
                    )

    def _ensure_capacity(self, needed: int, reason: str = "this forward") -> None:
        C = self.capacity
        if needed <= C:
            return
        if self.max_cache_len is not None:
            raise ValueError(
                f"{reason} needs {needed} KV slots per row, but the BoleCache holds max_cache_len="
                f"{self.max_cache_len}; create it with a larger max_cache_len (or None to grow it on demand)"
            )
        extra = -(-max(needed, 2 * C) // KV_GROWTH_STEP) * KV_GROWTH_STEP - C
        for group in self._groups:
            group.keys = _extend(group.keys, 3, extra, 0)
            group.values = _extend(group.values, 3, extra, 0)
            group.index_keys = _extend(group.index_keys, 2, extra, 0)
        self._valid = _extend(self._valid, 1, extra, True)
        if self._slot_positions is not None:
            self._slot_positions = _extend(self._slot_positions, 1, extra, 0)

    def _attention_index(self, layer_idx: int) -> tuple[int, int]:
        if layer_idx not in self._attn_index:
            raise ValueError(f"layer {layer_idx} is not a full-attention layer of this BoleCache")
        return self._attn_index[layer_idx]

    def _gdn(self, layer_idx: int) -> tuple[int, int]:
        """(device group, index in the group) of GDN layer `layer_idx`."""
        if layer_idx not in self._gdn_place:
            raise ValueError(f"layer {layer_idx} is not a GDN (linear_attention) layer of this BoleCache")
        return self._gdn_place[layer_idx]

    def _check_input(self, x: torch.Tensor, name: str, layer_idx: int, group: int) -> None:
        """A layer's input: of the cache's batch size, on the device that layer's state is kept on (a cache built
        for another placement would otherwise fail inside a scatter or a kernel)."""
        self._check_batch(x.shape[0], name)
        kept = self._groups[group].conv.device  # as its tensors report it ("cuda:0" for a cache made on "cuda")
        if x.device != kept:
            raise ValueError(
                f"layer {layer_idx} runs on {x.device}, but this BoleCache keeps its state on {kept}; build the "
                f"cache where the model's layers run: BoleCache.for_model(model, batch_size, max_cache_len)"
            )

    def _check_batch(self, batch: int, name: str) -> None:
        if batch != self._batch_size:
            raise ValueError(
                f"BoleCache was created for batch_size={self._batch_size}, but {name} has batch size {batch}; "
                f"create a cache per batch size"
            )

    def reset(self) -> None:
        """Empties every row (storage is kept)."""
        for group in self._groups:
            for t in (group.keys, group.values, group.conv, group.recurrent, group.index_keys, group.ple_conv):
                t.zero_()
            group.ple_tokens.fill_(self.layout.ple_fill)
        for t in (self.lengths, self.positions, self._slot_positions):
            if t is not None:
                t.zero_()
        self._valid.fill_(True)
        self._aligned_length, self._length_bound, self._observed = 0, 0, False
        self._gdn_started = dict.fromkeys(self._gdn_started, False)
        self._advance()

    def load_rows(self, rows: torch.Tensor, state: CacheState, positions: torch.Tensor) -> None:
        """Makes the rows `rows` hold `state` and nothing else, copied into the storage (whose addresses stay put where
        it holds the state's slots); the other rows keep what they hold.

        Args:
            rows (`torch.LongTensor` of shape `(n,)`): the rows to write, each once.
            state (`CacheState`): of `n` rows and `L > 0` slots each, from a cache of this model; the rows' slots
                hold tokens where its `valid` says so (all of them where it has none).
            positions (`torch.LongTensor` of shape `(n,)`): the position id each row's next token gets.
        """
        if state.length == 0 or state.batch_size != len(rows):
            raise ValueError(
                f"load_rows writes {len(rows)} rows, so it needs a state of {len(rows)} rows and at least one slot; "
                f"got {state.batch_size if state.length else 0} rows of {state.length} slots"
            )
        self._check_state(state)
        L = state.length
        self._ensure_capacity(L, f"a state of {L} slots")
        index = rows.to(self.device)
        for layer, (group, a) in self._attn_index.items():
            stored = self._groups[group]
            on = index.to(stored.device)
            for t, given in ((stored.keys, state.keys), (stored.values, state.values)):
                t[a, :, :, :L].index_copy_(0, on, given[layer].to(t.device))  # [n, Hkv, L, Dh] into [B, Hkv, L, Dh]
        for layer, (group, i) in self._index_place.items():
            stored = self._groups[group].index_keys
            stored[i, :, :L].index_copy_(0, index.to(stored.device), state.index_keys[layer].to(stored.device))
        if self._slot_positions is not None:
            self._slot_positions[:, :L].index_copy_(0, index, state.slot_positions.to(self.device))
        for layer, (group, g) in self._gdn_place.items():
            stored = self._groups[group]
            on = index.to(stored.device)
            stored.conv[g].index_copy_(0, on, state.conv[layer].to(stored.device))
            stored.recurrent[g].index_copy_(0, on, state.recurrent[layer].to(stored.device))
        for layer, (group, p) in self._ple_place.items():
            stored = self._groups[group]
            on = index.to(stored.device)
            stored.ple_conv[p].index_copy_(0, on, state.ple_conv[layer].to(stored.device))
            stored.ple_tokens[p, :, 0].index_copy_(0, on, state.ple_tokens[layer].to(stored.device))
        # [n, C]: the state's padding in its slots; the slots after it free, as in a fresh row
        valid = torch.ones(len(rows), self.capacity, dtype=torch.bool, device=self.device)
        if state.valid is not None:
            valid[:, :L] = state.valid.to(self.device)
        self._valid.index_copy_(0, index, valid)
        self.lengths.index_fill_(0, index, L)
        self.positions.index_copy_(0, index, positions.to(self.device))
        self._aligned_length = None
        self._length_bound = max(self._length_bound, L)
        self._gdn_started = dict.fromkeys(self._gdn_started, True)
        self._advance()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Keeps the rows `beam_idx` (beam search)."""
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keeps the rows `indices`, in that order (the batch size becomes `len(indices)`)."""
        indices = indices.to(self.device)
        for group in self._groups:
            on = indices.to(group.device)
            for name in ("keys", "values", "conv", "recurrent", "index_keys", "ple_conv", "ple_tokens"):  # [n, B, ...]
                setattr(group, name, getattr(group, name).index_select(1, on))
        for name in ("lengths", "positions", "_valid", "_slot_positions"):  # [B, ...]
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name).index_select(0, indices))
        self._batch_size = len(indices)
        self._advance()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(
            "BoleCache does not roll back: verify candidates with hf_bole.models.tree_forward and keep only the "
            "accepted ones with commit(path)"
        )

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.batch_select_indices(torch.arange(self._batch_size, device=self.device).repeat_interleave(repeats))

    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        """transformers 5.25's GDN conv counts a one-token decode's token in its cache layer's own counter: a BoleCache
        counts every row's tokens in `lengths` (advanced by the attention layers' `update`), so nothing to do."""

    def activate_past_recording(self, **kwargs) -> None:
        raise NotImplementedError("BoleCache does not record past states: it commits only accepted tree paths")
