"""The verify forward and node selection replayed from CUDA graphs (`bole_cuda_graphs=True`): one graph per tree
width, kept across `generate` calls together with the cache whose addresses the graphs hold.

A verify forward launches hundreds of kernels from Python (every layer, the GDN seams, the LM head); on a small or
mid-size model the GPU then waits for the host most of the time. Replaying a captured
graph launches them all at once. Nothing in the forward reads the device on the host (tested), its shapes depend
only on the batch size, the tree width and the cache's capacity, and the cache's state lives in tensors that keep
their addresses; so a graph captured once per width is valid for every later round of that width. Tree widths
are padded to a few buckets (padding nodes are children of the committed state and are never accepted). Node
selection (`SelectGraphs`) replays the same way, one graph per tree shape and budget, and so does a greedy round's
tail after its verify forward (`TailGraphs`: acceptance, commit, the drafter's next inputs).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from hf_bole.cache import BoleCache
from hf_bole.generation.select_kernel import select_round
from hf_bole.generation.tail import RoundTail, greedy_tail
from hf_bole.generation.tree import DraftTree, VerifyTree
from hf_bole.models import TreeForwardOutput, graph_unsafe_experts, placement, tree_forward

WIDTH_BUCKETS = (4, 8, 16, 32, 64, 128)
# Cache capacities are rounded up to this many slots, so that calls of similar lengths share one cache and its graphs.
CAPACITY_STEP = 512


def captures(model, cuda_graphs: bool) -> bool:
    """Whether verify forwards of `model` replay from CUDA graphs: asked for (`bole_cuda_graphs`), on one CUDA
    device (not spread over several by a device_map: a graph is captured on one device's stream), and no
    mixture-of-experts layers whose experts implementation routes tokens with data-dependent shapes
    (`graph_unsafe_experts`: transformers' "eager"; its default "grouped_mm" is captured)."""
    if not cuda_graphs:
        return False
    place = placement(model)
    return not place.spans_devices and place.input_device.type == "cuda" and not graph_unsafe_experts(model)


def width_bucket(width: int, max_width: int) -> int:
    """The width a tree of `width` nodes is verified at: the next bucket, at most `max_width` (the padded width
    selection gives every row)."""
    return min(next((b for b in WIDTH_BUCKETS if b >= width), max_width), max_width)


def row_width(budget: int, rows: int, max_width: int) -> int:
    """The width (root included) each row's tree is selected into and verified at, from the round's budget alone:
    the smallest bucket (`width_bucket`) whose `rows` rows hold the whole budget, at most `max_width`.

    Decided on the host before selection, so no round waits for the device to learn how wide its trees came out (the
    cut to the widest row kept that it replaces was such a read); selection caps every row there, and the forward
    runs at that width, a CUDA graph's. A cap costs a row nodes only where the batch-shared budget would pile more than
    its even share onto it, and then the tree keeps most of its accepted tokens while its forward runs narrower.
    """
    return width_bucket(-(-budget // max(rows, 1)) + 1, max_width)


def trimmed(verify: VerifyTree) -> VerifyTree:
    """`verify` cut to its widest row kept: a host read, which waits for drafting and selection. Forwards launched
    from Python cost by their width; a replayed one runs at its bucket (`row_width`) without the read."""
    return verify.narrowed(int(verify.num_nodes.max()))


def capture(run, device: torch.device, pool=None, warm_up: bool = True) -> tuple[torch.cuda.CUDAGraph, object]:
    """Captures `run()` into a CUDA graph drawing on memory `pool`; returns the graph and what the captured call
    returned (its output buffers, filled by each replay). With `warm_up`, `run` is called once eagerly on a side
    stream first, so that autotuning and first-use costs stay out of the capture: it must be safe to run twice
    (without, it must have run eagerly before). The captured work has not run yet: replay the graph."""
    if warm_up:
        side = _side_stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # Only this thread's calls are held to the capture's rules: another thread's plain forward of the model (a
    # cudaMalloc, a synchronisation) would fail during the capture otherwise.
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = run()
    return graph, out


# device -> a graph of one tiny kernel, kept so that its memory pool outlives the graphs `capture_queued` makes there
# and shares with them: a pool per graph would stay reserved after its graph is gone, until the allocator's cache is
# emptied, and torch (2.11) keeps a pool's count of graphs for pinned memory apart from the pool itself (a
# `torch.cuda.MemPool` held here trips its assertion once the last graph that used it is gone).
_ANCHORS: dict[torch.device, torch.cuda.CUDAGraph] = {}


def capture_queued(run, device: torch.device) -> tuple[torch.cuda.CUDAGraph, object]:
    """Captures `run()` like `capture` without warming up, while earlier work may still be queued: on a side stream,
    with no wait for the GPU and no emptying of the allocator's cache, which `torch.cuda.graph` does on entry (a
    round in flight drained, memory handed back to the driver, in the middle of a call). `run` must have run eagerly
    before; only this thread's calls are held to the capture's rules. The captured work has not run yet: replay
    the graph."""
    if device not in _ANCHORS:
        _ANCHORS[device], _ = _capture_on_side_stream(lambda: torch.zeros(1, device=device), device, None)
    return _capture_on_side_stream(run, device, _ANCHORS[device].pool())


# device -> the one side stream that warm-ups and `capture_queued` run on there. The caching allocator hands a freed
# block out again only on the stream it was allocated on: with a new stream (one of torch's 32 pooled ones, in turn)
# per capture, the shared pool grew by a segment at every capture of every call (2 MiB a call in
# `test_shape_graphs_capture_behind_queued_work_in_one_pool` on an H200). torch.cuda.graph, too, keeps one capture
# stream.
_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return _SIDE_STREAMS[device]


def _capture_on_side_stream(run, device: torch.device, pool) -> tuple[torch.cuda.CUDAGraph, object]:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(_side_stream(device)):
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            out = run()
        finally:
            graph.capture_end()
    return graph, out


class ShapeGraphs:
    """`run(*inputs)` replayed from a CUDA graph per input shape, captured in the middle of a `generate` call (the
    token writes of `loop._Writes`, kept across calls while they fit): the first call of a shape runs eagerly, which
    pays first-use costs such as cached index ranges, the second captures (`capture_queued`, no wait for the GPU),
    later ones copy their inputs in and replay. Returns `run`'s outputs, the graph's buffers from the second call on:
    valid until the next call."""

    def __init__(self, run):
        self.run = run
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...], object]] = {}
        self._seen: set[tuple] = set()

    def __call__(self, *inputs: torch.Tensor):
        key = tuple((x.shape, x.dtype) for x in inputs)
        entry = self._graphs.get(key)
        if entry is None:
            if key not in self._seen:
                self._seen.add(key)
                return self.run(*inputs)
            static = tuple(x.clone() for x in inputs)
            graph, out = capture_queued(lambda: self.run(*static), inputs[0].device)
            entry = self._graphs[key] = (graph, static, out)
        else:
            for buffer, value in zip(entry[1], inputs):
                buffer.copy_(value)
        entry[0].replay()
        return entry[2]


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    input_ids: torch.Tensor  # [B, W] static inputs
    parents: torch.Tensor  # [B, W]
    out: TreeForwardOutput  # static outputs
    tree_round: object  # the cache's round buffers the graph writes (kept alive with it)


class VerifyGraphs:
    """`tree_forward(model, cache, input_ids, parents, verify, compile, fuse_projections, attention)` replayed from a
    CUDA graph per tree width.

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

    def __call__(self, input_ids: torch.Tensor, parents: torch.Tensor) -> TreeForwardOutput:
        """The verify forward of trees `[B, W]`; the outputs are the graph's buffers, valid until the next call."""
        width = input_ids.shape[1]
        # The graph checks nothing on the host when it replays: make sure the tree fits in the cache here.
        self.cache._reserve_tree(width)
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
        self.cache.resume_round(entry.tree_round)
        return entry.out

    def _capture(self, input_ids: torch.Tensor, parents: torch.Tensor) -> _Graph:
        input_ids, parents = input_ids.clone(), parents.clone()
        # Tree mode leaves the committed state alone, so the forward may run any number of times.
        graph, out = capture(
            lambda: tree_forward(
                self.model, self.cache, input_ids, parents, self.verify, self.compile, self.fuse_projections,
                self.attention,
            ),  # fmt: skip
            input_ids.device,
            self._pool,
        )
        self._pool = graph.pool()
        graph.replay()  # the capture only recorded the work
        return _Graph(graph, input_ids, parents, out, self.cache.current_round())


class SelectGraphs:
    """`select_round(tree, root_tokens, budget, max_nodes_per_row, active, safe)` replayed from a CUDA graph per
    (tree shape, budget, cap, safe): one kernel, or select_nodes' hundred small ops past the kernel's size, with the
    tree's preparation (`prepared_tree`) and the copies of the round's tree into the graph's inputs, launched while
    the GPU waits for the round's tree. Returns the graph's buffers, valid until the next call."""

    def __init__(self):
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...], VerifyTree]] = {}
        self._pool = None

    def __call__(
        self,
        tree: DraftTree,
        root_tokens: torch.Tensor,
        budget: int,
        max_nodes_per_row: int,
        active: torch.Tensor | None = None,
        safe: tuple[int, int] | None = None,
    ) -> VerifyTree:
        inputs = (tree.tokens, tree.parents, tree.draft_logprobs, root_tokens, *([] if active is None else [active]))
        key = (tuple(tree.tokens.shape), tree.draft_logprobs.dtype, budget, max_nodes_per_row, active is None, safe)
        if key not in self._graphs:
            static = tuple(x.clone() for x in inputs)

            def run() -> VerifyTree:
                tree, roots = DraftTree(*static[:3]), static[3]
                return select_round(tree, roots, budget, max_nodes_per_row, *static[4:], safe=safe)

            graph, out = capture(run, root_tokens.device, self._pool)
            self._pool = graph.pool()
            self._graphs[key] = (graph, static, out)
        graph, static, out = self._graphs[key]
        for buffer, value in zip(static, inputs):
            buffer.copy_(value)
        graph.replay()
        return out


class TailGraphs:
    """`greedy_tail(cache, verify, logits, hidden_states, active, step, width)` replayed from a CUDA graph per
    (input buffers, step, width): the acceptance kernel, the commit's kernels and the drafter's next inputs, about
    twenty launches and their checks in Python (0.6 ms of host time a round), in one replay.

    The graph reads its inputs where they are, so they must be buffers that keep their addresses: the selection
    graphs' trees (`SelectGraphs`) and the verify graphs' outputs (`VerifyGraphs`) of the cache; a graph is made
    per combination of them (a few budgets and widths), and `active` is copied in. It writes the cache's state
    like `commit`; the first call with new buffers runs eagerly, which compiles the kernels (a capture must not),
    the second captures, and a replay is followed by the host-side record of the commit
    (`BoleCache.record_commit`). Returns the graph's buffers, valid until the next call: the next round's drafting,
    selection and token write read them before the next replay.
    """

    def __init__(self, cache: BoleCache):
        self.cache = cache
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor, RoundTail]] = {}
        self._seen: set[tuple] = set()  # keys run eagerly once, captured on their next call
        self._pool = None

    def clear(self) -> None:
        """Forgets every graph (the cache's storage changed)."""
        self._graphs.clear()
        self._seen.clear()
        self._pool = None

    def __call__(
        self,
        verify: VerifyTree,
        out: TreeForwardOutput,
        active: torch.Tensor,
        step: int,
        width: int | None,
    ) -> RoundTail:
        inputs = (verify.input_ids, verify.parents, verify.depths, verify.node_mask, out.logits, out.hidden_states)
        key = (tuple((x.data_ptr(), x.shape, x.stride(), x.dtype) for x in inputs), active.shape, step, width)
        entry = self._graphs.get(key)
        if entry is None:
            if key not in self._seen:
                self._seen.add(key)
                return greedy_tail(self.cache, verify, out.logits, out.hidden_states, active, step, width)
            static_active = active.clone()
            # Not warmed up: the tail writes the cache. The capture runs the commit's host-side record once, which
            # the replay below is the commit of.
            graph, tail = capture(
                lambda: greedy_tail(self.cache, verify, out.logits, out.hidden_states, static_active, step, width),
                active.device,
                self._pool,
                warm_up=False,
            )
            self._pool = graph.pool()
            self._graphs[key] = (graph, static_active, tail)
            graph.replay()
            return tail
        graph, static_active, tail = entry
        static_active.copy_(active)
        graph.replay()
        self.cache.record_commit(tail.committed_width)
        return tail


class CommitGraphs:
    """`cache.commit(path, check_values=False)` replayed from a CUDA graph per (path shape, tree round): the prefill
    chains' commits (`generation/prefill.py`), whose paths are whole chains. Launched from Python a commit is about a
    dozen launches, three of them Triton kernels; with the chain's other launches it kept the host busier than the
    GPU on a small model.

    The tree round is the verify forward's replayed just before (`VerifyGraphs` keeps one per width), whose buffers
    the commit reads where they are. As in `TailGraphs`, the first call of a key runs eagerly, the second captures
    (the capture runs the commit's host-side record once, and its replay is that commit), and later ones copy the
    path in, replay, and make the host-side record (`BoleCache.record_commit`).
    """

    def __init__(self, cache: BoleCache):
        self.cache = cache
        # key -> the graph, its static path and the round it commits (held, so that the key's id stays its own)
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor, object]] = {}
        self._seen: set[tuple] = set()

    def clear(self) -> None:
        """Forgets every graph (the cache's storage changed)."""
        self._graphs.clear()
        self._seen.clear()

    def __call__(self, path: torch.Tensor) -> None:
        """Commits `path [B, L]` of the last verify forward, as `BoleCache.commit` does without reading it."""
        tree_round = self.cache.current_round()
        key = (tuple(path.shape), id(tree_round))
        entry = self._graphs.get(key)
        if entry is None:
            if key not in self._seen:
                self._seen.add(key)
                self.cache.commit(path, check_values=False)
                return
            static = path.clone()
            graph, _ = capture_queued(lambda: self.cache.commit(static, check_values=False), path.device)
            self._graphs[key] = (graph, static, tree_round)
            graph.replay()
            return
        graph, static, _ = entry
        static.copy_(path)
        graph.replay()
        self.cache.record_commit(path.shape[1])


# model -> {(batch size, verify, compile, fuse_projections, attention): (cache, graphs)}: one cache per batch size and
# settings, reused (reset, and grown for a call that starts longer) by later calls.
_STORE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def graphed_cache(
    model,
    batch_size: int,
    capacity: int,
    verify: str,
    compile: bool = False,
    fuse_projections: bool = True,
    attention: str = "auto",
) -> tuple[BoleCache, VerifyGraphs]:
    """An empty `BoleCache` of at least `capacity` slots per row (in steps of `CAPACITY_STEP`) for `model` on its CUDA
    device, which grows on demand, and the verify graphs that go with it; both are kept for the next call of the same
    batch size, verify mode, `compile`, `fuse_projections` and `attention`."""
    per_model = _STORE.setdefault(model, {})
    key = (batch_size, verify, compile, fuse_projections, attention)
    if key not in per_model:
        cache = BoleCache.for_model(model, batch_size)
        per_model[key] = (cache, VerifyGraphs(model, cache, verify, compile, fuse_projections, attention))
    cache, graphs = per_model[key]
    cache.reset()
    cache.reserve(-(-capacity // CAPACITY_STEP) * CAPACITY_STEP)
    return cache, graphs


_SELECT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def graphed_select(model) -> SelectGraphs:
    """The selection graphs of `model`'s `generate` calls, kept across calls like its verify graphs."""
    if model not in _SELECT:
        _SELECT[model] = SelectGraphs()
    return _SELECT[model]


def drop_graphs(model) -> None:
    """Forgets the caches and graphs kept for `model`'s next calls (their memory is freed once unreferenced)."""
    _STORE.pop(model, None)
    _SELECT.pop(model, None)
