"""A small drafter model's forwards over trees from its committed tokens, and their commit: the state the small-model
drafter (`drafters/model.py`) keeps across rounds, rolled back to nothing but what it commits.

Two kinds of drafter model, one interface (`DraftModelTrees`):

    a transformer (every layer full attention: Llama, Qwen2, Qwen3, ...)   `TreeKVCache`, its per-row KV: a tree's
        nodes are written after each row's committed slots and attend to the committed slots and their ancestors
        (`kernels.tree_masks`); `commit(path)` moves a path's KV into place (`kernels.kv_commit`)
    a hybrid GDN model of a supported family (a small Qwen3.5)   a `BoleCache`, verified by `tree_forward` and
        committed by `BoleCache.commit` from the forward's `TreeRound`, as the target is

Nothing of a tree forward is kept unless committed: the next tree starts from the committed state again.
"""

from __future__ import annotations

import torch
from transformers import Cache, PreTrainedModel
from transformers.cache_utils import CacheLayerMixin

from hf_bole.cache import BoleCache, TreeRound
from hf_bole.kernels import kv_commit, tree_masks
from hf_bole.models import cache_argument, check_supported_model, family_of, tree_forward

CAPACITY_STEP = 256  # a drafter's KV slots per row grow in multiples of this (at least doubling)
TREE_ATTENTION = ("sdpa", "eager")  # implementations that take the tree's arbitrary 4D mask


class _TreeKVLayer(CacheLayerMixin):
    """A layer of a `TreeKVCache`: its `update` is the cache's."""

    is_compileable = False
    is_sliding = False

    def __init__(self, cache: TreeKVCache, layer_idx: int):
        self.cache, self.layer_idx = cache, layer_idx
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the cache allocates its storage."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self.cache.update(key_states, value_states, self.layer_idx)

    def get_seq_length(self) -> int:
        return self.cache.get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.capacity, 0

    def get_max_length(self) -> int:
        return -1


class TreeKVCache(Cache):
    """
    The KV of a transformer drafter, per row: slot j of row b holds the j-th committed token of the row (no padding:
    rows are fed without it), `lengths [B]` committed slots. A forward writes its node i of row b to slot
    `lengths[b] + i` (`slots`), which the next forward overwrites unless `commit` kept it.

    Storage `keys`, `values` `[L, B, Hkv, C, D]` (all layers stacked, for one `kv_commit`), made at the first layer's
    first write from its shapes; C grows in steps of `CAPACITY_STEP`.
    """

    def __init__(self, num_layers: int, batch_size: int, device: torch.device):
        super().__init__(layers=[_TreeKVLayer(self, i) for i in range(num_layers)])
        self.num_layers, self.device = num_layers, device
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.capacity = 0
        self.valid = torch.ones(batch_size, 0, dtype=torch.bool, device=device)  # [B, C]: no slot is padding
        self.slots: torch.Tensor | None = None  # [B, N] where the forward in flight writes
        self._bound = 0  # an upper bound of max(lengths), on the host

    def reserve(self, num_nodes: int) -> None:
        """Room for a tree of `num_nodes` after the longest row (grows the storage, keeping the committed slots)."""
        needed = self._bound + num_nodes
        if needed <= self.capacity:
            return
        new = max(2 * self.capacity, -(-needed // CAPACITY_STEP) * CAPACITY_STEP)
        if self.keys is not None:
            pad = lambda t: torch.cat([t, t.new_zeros(*t.shape[:3], new - self.capacity, t.shape[4])], dim=3)  # noqa: E731
            self.keys, self.values = pad(self.keys), pad(self.values)
        self.capacity = new
        self.valid = torch.ones(self.valid.shape[0], new, dtype=torch.bool, device=self.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Writes the forward's keys/values `[B, Hkv, N, D]` of layer `layer_idx` to `slots`; returns the layer's whole
        storage `[B, Hkv, C, D]`, which the tree mask indexes."""
        B, H, N, D = key_states.shape
        if self.keys is None:
            shape = (self.num_layers, B, H, self.capacity, D)
            self.keys = torch.zeros(shape, dtype=key_states.dtype, device=key_states.device)
            self.values = torch.zeros_like(self.keys)
        if self.keys.shape[2:] != (H, self.capacity, D) or key_states.dtype != self.keys.dtype:
            raise ValueError(
                f"the drafter's layer {layer_idx} has keys of {H} heads of {D} dims in {key_states.dtype}, its first "
                f"layer {self.keys.shape[2]} of {self.keys.shape[4]} in {self.keys.dtype}: a small-model drafter "
                f"needs the same KV shape in every layer"
            )
        index = self.slots[:, None, :, None].expand(B, H, N, D)
        self.keys[layer_idx].scatter_(2, index, key_states)
        self.values[layer_idx].scatter_(2, index, value_states)
        return self.keys[layer_idx], self.values[layer_idx]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._bound

    def commit(self, path: torch.Tensor) -> None:
        """Keeps each row's path `[B, L]` (nodes of the last forward, root-to-leaf, right-padded with -1)."""
        kv_commit(self.keys, self.values, self.lengths, path)
        self.lengths.add_((path >= 0).sum(1))
        self._bound += path.shape[1]


class DraftModelTrees:
    """
    Forwards of a drafter model over trees from its committed tokens, and their commit (see the module docstring).

    Args:
        model (`PreTrainedModel`): the drafter, a causal LM.
        batch_size (`int`): rows.
    """

    def __init__(self, model: PreTrainedModel, batch_size: int):
        check_draft_model(model)
        self.model, self.batch_size = model, batch_size
        self.hybrid = _is_hybrid(model)
        self.device = model.get_input_embeddings().weight.device
        if self.hybrid:
            self.cache = BoleCache.for_model(model, batch_size)
            self._round: TreeRound | None = None  # the last forward's; the next forward of its shape fills its buffers
        else:
            config = model.config.get_text_config(decoder=True)
            self.cache = TreeKVCache(config.num_hidden_layers, batch_size, self.device)
            self._cache_argument = cache_argument(type(model).forward)

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        """The drafter's logits `[B, N, vocab]` at every node of trees `tokens`, `parents` (`[B, N]`; parent -1: a child
        of the row's last committed token; node 0's parent is -1), from the committed state, which is kept as it is."""
        if self.hybrid:
            out = tree_forward(self.model, self.cache, tokens, parents.to(self.cache.device), tree_round=self._round)
            self._round = out.tree_round
            return out.logits
        cache = self.cache
        cache.reserve(tokens.shape[1])
        # no padding slots: positions are the committed counts
        _, position_ids, mask = tree_masks(parents, cache.lengths, cache.lengths, cache.valid)
        if self.model.config._attn_implementation == "eager":  # eager attention adds its mask
            dtype = self.model.get_input_embeddings().weight.dtype
            mask = torch.where(mask, torch.zeros((), dtype=dtype, device=mask.device), torch.finfo(dtype).min)
        cache.slots = cache.lengths[:, None] + torch.arange(tokens.shape[1], device=self.device)
        out = self.model(
            input_ids=tokens, attention_mask=mask, position_ids=position_ids, use_cache=True,
            **{self._cache_argument: cache},
        )  # fmt: skip
        return out.logits

    def commit(self, path: torch.Tensor) -> None:
        """Keeps each row's path `[B, L]` of the last `logits` call (root-to-leaf, right-padded with -1)."""
        if self.hybrid:
            self.cache.commit(self._round, path.to(self.cache.device), check_values=False)
        else:
            self.cache.commit(path)


def _is_hybrid(model: PreTrainedModel) -> bool:
    try:
        family_of(model.config)
    except ValueError:
        return False
    return True


def check_draft_model(model) -> None:
    """Raises a `ValueError` unless `model` can draft: a decoder-only causal LM whose layers are all full attention
    (under "sdpa" or "eager" attention), or a model of a supported GDN family (`hf_bole.models.family`)."""
    if not isinstance(model, PreTrainedModel) or model.get_output_embeddings() is None:
        raise ValueError(
            f"a small-model drafter is a causal LM (a PreTrainedModel with an LM head), got {type(model).__name__}"
        )
    if _is_hybrid(model):
        check_supported_model(model)
        return
    config = model.config.get_text_config(decoder=True)
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if config.is_encoder_decoder or layer_types != {"full_attention"}:
        raise ValueError(
            f"a small-model drafter is a decoder-only transformer whose layers are all full attention, or a hybrid "
            f"GDN model hf_bole verifies; {type(model).__name__} has layer types {sorted(layer_types)}"
            + (" (encoder-decoder)" if config.is_encoder_decoder else "")
        )
    if config._attn_implementation not in TREE_ATTENTION:
        raise ValueError(
            f"the drafter attends to its trees with a 4D mask, which attn_implementation="
            f"{config._attn_implementation!r} cannot take; load it with attn_implementation='sdpa' (or 'eager')"
        )
