"""Step 3 of a round, verify: one target forward over every row's tree from the committed state
(`hf_bole.models.tree_forward`), launched from Python (`Verify`) or replayed from a CUDA graph per tree width
(`VerifyGraphs`, with `bole_cuda_graphs`). It hands on what accept and commit need as a value: the tree it verified,
the logits and hidden states, and the tree round (`TreeRound`: the GDN factors or snapshots and the pre-conv inputs)
that the commit reads.

A verify forward launches hundreds of kernels from Python (every layer, the GDN seams, the LM head); on a small or
mid-size model the GPU then waits for the host most of the time. Replaying a captured graph launches them all at
once. Nothing in the forward reads the device on the host (tested), its shapes depend only on the batch size, the
tree width and the cache's capacity, and the cache's state and the round's buffers keep their addresses; so a graph
captured once per width is valid for every later round of that width.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from hf_bole.cache import BoleCache
from hf_bole.cache.bole_cache import ATTENTION_LAYER_TYPES
from hf_bole.cache.layout import state_layout
from hf_bole.generation import graphs
from hf_bole.generation.commit import CommitGraphs, TailGraphs
from hf_bole.generation.tree import VerifyTree
from hf_bole.models import TreeForwardOutput, family_of, tree_forward


def round_bytes(config, width: int, dtype: torch.dtype, verify: str = "closed_form") -> dict[str, int]:
    """Bytes one request's verify round of `width` nodes (the root included) holds while it is in flight: the tree
    state the commit reads (`TreeRound.transient_bytes`: GDN factors k, u and log-decay in closed form, or a state
    snapshot per node in serial mode; every GDN layer's pre-conv input, and a per-layer embedding's conv input and
    token; the tree's KV, written into the cache's free slots) and the forward's outputs (`logits` at every node, in
    `dtype`, and the final hidden states). A batch of B requests holds B times as much: the width is per row
    (`select.row_width`), so it never scales with the batch times a budget. Replayed from CUDA graphs, each width a call
    met keeps its buffers in its graph.

    Args:
        config: the model's (text) config.
        width (`int`): nodes per row, the root included.
        dtype (`torch.dtype`): the model's dtype (factors and states are float32 whatever it is).
        verify (`str`): "closed_form" or "serial".

    Returns:
        `dict[str, int]`: bytes per request by part, the keys of `TreeRound.transient_bytes` and `logits`,
        `hidden_states`.
    """
    config = config.get_text_config(decoder=True)
    layout = state_layout(config)
    gdn = sum(t == "linear_attention" for t in config.layer_types)
    attention = sum(t in ATTENTION_LAYER_TYPES for t in config.layer_types)
    ple = len(layout.ple_layers)  # Qwen4-Exp's per-layer embeddings
    hk, k = layout.linear_key_heads, layout.linear_key_dim
    hv, v = layout.linear_value_heads, layout.linear_value_dim
    size, f32 = dtype.itemsize, 4
    closed = verify == "closed_form"
    decay = hv * k if layout.per_key_decay else hv  # KDA's g per key channel, GDN's log-decay per head
    per_node = {
        "factors": gdn * (hk * k * size + hv * v * f32 + decay * f32) if closed else 0,
        "snapshots": 0 if closed else gdn * hv * k * v * f32,
        "conv_inputs": gdn * layout.conv_dim * size + ple * (layout.ple_dim * size + 8),  # the token as int64
        "tree_kv": attention * layout.kv_heads * (layout.key_dim + layout.value_dim) * size,
        "logits": config.vocab_size * size,
        "hidden_states": config.hidden_size * size,
    }
    return {part: width * n for part, n in per_node.items()}


@dataclass
class Verified:
    """What step 3 hands to accept and commit."""

    tree: VerifyTree  # the trees the forward verified (cut to the widest row kept where launched from Python)
    out: TreeForwardOutput  # logits and hidden states at every node, and the tree round to commit from


def trimmed(verify: VerifyTree) -> VerifyTree:
    """`verify` cut to its widest row kept: a host read, which waits for drafting and selection. Forwards launched
    from Python cost by their width; a replayed one runs at its bucket (`select.row_width`) without the read."""
    return verify.narrowed(int(verify.num_nodes.max()))


class Verify:
    """Step 3 launched from Python: `verify(tree, rows)` runs `tree_forward` at the widest row's exact width (a host
    read that waits for drafting and selection, skipped by a pipelined round of one row), filling the last round's
    buffers again where the width repeats.

    Args:
        model, cache: what `tree_forward` runs.
        verify, compile, fuse_projections, attention: `tree_forward`'s settings.
        pipelined (`bool`): rounds are queued before the host reads the previous one's tokens (`BoleConfig.pipeline`).
    """

    def __init__(self, model, cache: BoleCache, verify: str, compile: bool, fuse_projections: bool, attention: str,
                 pipelined: bool):  # fmt: skip
        self.model, self.cache, self.pipelined = model, cache, pipelined
        self.settings = dict(verify=verify, compile=compile, fuse_projections=fuse_projections, attention=attention)
        self._round = None  # the last forward's round, whose buffers a forward of the same width fills again

    def __call__(self, tree: VerifyTree, rows: int) -> Verified:
        if rows > 1 or not self.pipelined:
            tree = trimmed(tree)
        return Verified(tree, self.forward(tree.input_ids, tree.parents.to(self.cache.device)))

    def forward(self, input_ids: torch.Tensor, parents: torch.Tensor) -> TreeForwardOutput:
        """`tree_forward` of trees `[B, W]` (the prefill's chains too), into the last round's buffers where they fit."""
        out = tree_forward(self.model, self.cache, input_ids, parents, **self.settings, tree_round=self._round)
        self._round = out.tree_round
        return out


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    input_ids: torch.Tensor  # [B, W] static inputs
    parents: torch.Tensor  # [B, W]
    out: TreeForwardOutput  # static outputs, the round's buffers the graph writes among them


class VerifyGraphs:
    """`tree_forward(model, cache, input_ids, parents, verify, compile, fuse_projections, attention)` replayed from a
    CUDA graph per tree width; as step 3, `step(tree, rows)`.

    The graphs hold the cache's storage's addresses: when a tree does not fit and the cache grows
    (`max_cache_len=None`), every graph of the cache (these, its tails' and its commits') is dropped and captured
    again.

    Args:
        model: a Qwen3.5 model hf_bole supports, on a CUDA device.
        cache (`BoleCache`): the cache the forwards verify from.
        verify (`str`): "closed_form" or "serial".
        compile (`bool`): capture the `torch.compile`d forward (`tree_forward`'s `compile`).
        fuse_projections (`bool`): `tree_forward`'s `fuse_projections`.
        attention (`str`): `tree_forward`'s `attention`.
    """

    def __init__(
        self,
        model,
        cache: BoleCache,
        verify: str,
        compile: bool = False,
        fuse_projections: bool = True,
        attention: str = "auto",
    ):
        self.model, self.cache, self.verify, self.compile = model, cache, verify, compile
        self.fuse_projections, self.attention = fuse_projections, attention
        self._graphs: dict[int, _Graph] = {}
        self._pool = None
        # The tails and the prefill chains' commits read these graphs' outputs where they are: they go with them.
        self.tail = TailGraphs(cache)
        self.commit = CommitGraphs(cache)
        self._capacity = cache.capacity  # the storage the graphs hold

    def step(self, tree: VerifyTree, rows: int) -> Verified:
        """Step 3: the forward at the width selection gave every row (`select.row_width`), with no host read."""
        return Verified(tree, self(tree.input_ids, tree.parents.to(self.cache.device)))

    def __call__(self, input_ids: torch.Tensor, parents: torch.Tensor) -> TreeForwardOutput:
        """The verify forward of trees `[B, W]`; the outputs (the tree round's among them) are the graph's buffers,
        valid until the next call."""
        width = input_ids.shape[1]
        # The graph checks nothing on the host when it replays: make sure the tree fits in the cache here, with the
        # padding nodes `tree_forward` adds to trees narrower than the family's `min_tree_nodes`.
        self.cache._reserve_tree(max(width, family_of(self.model.config).min_tree_nodes))
        if self.cache.capacity != self._capacity:  # it grew: new storage
            self._graphs.clear()
            self._pool = None  # a new pool: CUDA refuses to capture into one whose graphs are gone while memory is held
            self.tail.clear()
            self.commit.clear()
            self._capacity = self.cache.capacity
        entry = self._graphs.get(width)
        if entry is None:
            entry = self._graphs[width] = self._capture(input_ids, parents)
        else:
            entry.input_ids.copy_(input_ids)
            entry.parents.copy_(parents)
            entry.graph.replay()
        self.cache.mark_verified(entry.out.tree_round)
        return entry.out

    def _capture(self, input_ids: torch.Tensor, parents: torch.Tensor) -> _Graph:
        input_ids, parents = input_ids.clone(), parents.clone()
        tree_round = self.cache.new_round(parents, self.verify)  # the round every replay fills
        # Tree mode leaves the committed state alone, so the forward may run any number of times.
        graph, out = graphs.capture(
            lambda: tree_forward(
                self.model, self.cache, input_ids, parents, self.verify, self.compile, self.fuse_projections,
                self.attention, tree_round,
            ),  # fmt: skip
            input_ids.device,
            self._pool,
        )
        self._pool = graph.pool()
        graph.replay()  # the capture only recorded the work
        return _Graph(graph, input_ids, parents, out)


# model -> {(batch size, verify, compile, fuse_projections, attention): (cache, graphs)}: one cache per batch size and
# settings, reused (reset, and grown for a call that starts longer) by later calls.
_KEPT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def graphed_cache(
    model,
    batch_size: int,
    capacity: int,
    verify: str,
    compile: bool = False,
    fuse_projections: bool = True,
    attention: str = "auto",
    continued: object | None = None,
) -> tuple[BoleCache, VerifyGraphs]:
    """An empty `BoleCache` of at least `capacity` slots per row (in steps of `graphs.KEPT_CAPACITY_STEP`) for `model`
    on its CUDA device, which grows on demand, and the verify graphs that go with it; both are kept for the next call
    of the same batch size, verify mode, `compile`, `fuse_projections` and `attention`. Where the call continues from
    the kept cache itself (`continued`: the cache the caller passed, which an earlier call returned), it is not
    emptied."""
    per_model = _KEPT.setdefault(model, {})
    key = (batch_size, verify, compile, fuse_projections, attention)
    if key not in per_model:
        cache = BoleCache.for_model(model, batch_size)
        per_model[key] = (cache, VerifyGraphs(model, cache, verify, compile, fuse_projections, attention))
    cache, kept = per_model[key]
    if cache is not continued:
        cache.reset()
    cache.reserve(-(-capacity // graphs.KEPT_CAPACITY_STEP) * graphs.KEPT_CAPACITY_STEP)
    return cache, kept


def drop_verify_graphs(model) -> None:
    """Forgets the caches and verify graphs kept for `model` (`hf_bole.release`; their memory is freed once
    unreferenced)."""
    _KEPT.pop(model, None)
