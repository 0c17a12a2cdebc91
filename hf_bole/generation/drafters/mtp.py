"""The default drafter: EAGLE-2-style tree drafting with the checkpoint's own MTP head (`hf_bole.models.mtp`).

Every call does two things, all rows of the batch at once:

1. extend: the A new committed entries, pairs (target final hidden h_t, next token x_{t+1}) at position t, run
   through the MTP head; their keys/values are written into the drafter's cache behind each row's earlier entries
   (each row its own length, padding entries dropped), exactly as the head saw them in training.
2. draft: the output o at the last entry (whose token is the root) gives the root's children. The tree then grows
   one depth per MTP step: the `topk` best nodes of the deepest level (by cumulative draft probability, the
   frontier) each get their `topk` most likely children. A depth-d node is the entry (o_parent, token) at position
   root_position + d, where o_parent is the head's own output at its parent; it attends to the row's committed
   entries and its ancestors in the tree. The tree's keys/values are scratch: the next call brings the accepted
   tokens back in as committed entries, with the target's hidden states.

Of the `topk + (depth - 1) * topk**2` drafted nodes, the best `max_nodes` by cumulative draft probability are
returned (a prefix-closed set: a child's cumulative log-probability never exceeds its parent's, and ties keep the
shallower node first).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn
from torch._dynamo.exc import FailOnRecompileLimitHit
from transformers import PreTrainedModel
from transformers.utils import logging

from hf_bole.generation.drafters.base import DraftContext
from hf_bole.generation.drafters.topk_tree import TopkLevels
from hf_bole.generation.graphs import capture
from hf_bole.generation.tree import DraftTree
from hf_bole.kernels.attention import MAX_QUERY_ROWS
from hf_bole.kernels.ops import row_topk
from hf_bole.kernels.topk import MAX_K, naive_row_topk
from hf_bole.models import attention_backends, graph_unsafe_experts
from hf_bole.models.mtp import Qwen3_5MTP
from hf_bole.models.twin import tree_twin

logger = logging.get_logger(__name__)

# The drafter's KV cache grows in steps of this many entries (and at least doubles), so reallocations are rare.
_MTP_KV_GROWTH_STEP = 256
# Under CUDA graphs a prompt's extension replays one graph per batch size over chunks of this many entries (the last
# padded): a prompt's length changes from call to call, a chunk's does not.
_EXTEND_CHUNK = 128
# torch.compile's compiles of `_round` allowed in one process. dynamo counts them per code object, so every drafter
# (one per depth, topk and launch) shares them; past its default of 8 it ran rounds eagerly with a log line only. In
# a sweep of chains of depth 3-12 and trees of 6-12 the trees of depth 8 and more drafted that way, a third slower.
_RECOMPILE_LIMIT = 64



class MTPDrafter:
    r"""
    Drafts token trees with the target's MTP head (`mtp.*` weights), keeping its own KV cache of the committed entries.

    Args:
        mtp (`Qwen3_5MTP`):
            The MTP head.
        embed_tokens (`nn.Module`):
            The target's input embedding.
        lm_head (`nn.Module`):
            The target's output projection.
        rotary_emb (`nn.Module`):
            The target's rotary embedding, called as `rotary_emb(x, position_ids)` with the position ids
            `mtp.rotary_position_ids` gives (`[3, B, T]` for Qwen3.5, `[B, T]` for Qwen3-Next).
        depth (`int`):
            The deepest level drafted (1 = the root's children only).
        topk (`int`):
            Children per expanded node, and nodes expanded per level.
        max_nodes (`int`, *optional*):
            A cap on nodes per row on top of each call's `ctx.max_nodes`.
        cuda_graphs (`bool`, *optional*, defaults to `False`):
            On CUDA, replay a round's drafting (the cache extension by the accepted entries, then the tree
            expansion) from a CUDA graph per (batch size, new entries, tree size); see `BoleConfig.cuda_graphs`.
            A call that brings in more than `depth + 1` entries (a prompt) extends the cache by all but each row's
            last `depth + 1` in chunks of 128 entries replayed from a graph of their own, and drafts from those
            through a round's graph.
        compile (`bool`, *optional*, defaults to `False`):
            Run a round's drafting (the same calls) through `torch.compile`, which fuses the head's norms, rotary
            embedding and the tree bookkeeping between its steps into fewer kernels; with `cuda_graphs` the compiled
            code is what the graphs capture. The first rounds compile a few times: static, then with the sizes that
            changed (new entries, tree size) symbolic, and once for a round that brings in a single entry (sizes 0
            and 1 are always specialised). See `BoleConfig.compile`.
        fuse_projections (`bool`, *optional*, defaults to `False`):
            Run the head's projections that read one input (attention's q, k and v, the MLP's gate and up) as one
            GEMM each (`hf_bole/models/fused.py`), as the verify forward does; see `BoleConfig.fuse_projections`.
            Fewer launches a step: at batch 1 an MTP forward is mostly small kernels, its GEMMs among them.

    Example:
        ```python
        >>> drafter = MTPDrafter.from_model(model, depth=4, topk=4)
        >>> tree = drafter.propose(ctx)  # DraftTree: tokens, parents, draft_logprobs, each [B, N]
        ```
    """

    def __init__(
        self,
        mtp: Qwen3_5MTP,
        embed_tokens: nn.Module,
        lm_head: nn.Module,
        rotary_emb: nn.Module,
        *,
        depth: int,
        topk: int,
        max_nodes: int | None = None,
        cuda_graphs: bool = False,
        compile: bool = False,
        fuse_projections: bool = False,
    ):
        if max_nodes is not None and max_nodes < 1:
            raise ValueError(f"MTPDrafter needs max_nodes >= 1 (or None), got {max_nodes}")
        self.check_settings(mtp.config, depth, topk, lm_head.weight.shape[0])
        self.mtp, self.embed_tokens, self.lm_head, self.rotary_emb = mtp, embed_tokens, lm_head, rotary_emb
        self.depth, self.topk, self.max_nodes = depth, topk, max_nodes
        if topk > MAX_K:
            logger.warning_once(
                f"hf_bole: the MTP drafter picks topk={topk} children with torch.topk, slower on a GPU than "
                f"hf_bole's kernel, which takes topk <= {MAX_K}"
            )
        self._cache: _MTPKVCache | None = None
        # Experts run by transformers' "eager" implementation (or grouped_mm outside bf16) route tokens on the host,
        # which a CUDA graph cannot hold (the layer's config is a copy of the target's, made when the drafter was built).
        unsafe = graph_unsafe_experts(mtp)
        self.cuda_graphs = cuda_graphs and not unsafe
        if cuda_graphs and unsafe:
            logger.warning_once(
                f"hf_bole: the MTP drafter's layer is a mixture of experts that CUDA graphs cannot capture "
                f"({unsafe[0]}); it drafts without them (bf16 'grouped_mm' and 'batched_mm' can be captured; "
                f"bole_cuda_graphs=False says the same without this warning)"
            )
        self._graphs: dict[tuple[int, int, int], _GraphedDraft] = {}  # (batch size, new entries, nodes) -> graph
        # batch size -> a prompt chunk's extension: its graph and static inputs (`_extend_replayed`)
        self._extend_graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]] = {}
        self._graph_pool = None
        self.compile = compile
        self.fuse_projections = fuse_projections
        self._head = mtp  # what a drafting step calls: `mtp`, or its twin with fused projections (set by `propose`)
        # made on first use: compiling happens on the first call, and a drafter that never drafts compiles nothing
        self._compiled_round = None

    @staticmethod
    def check_settings(config, depth: int, topk: int, vocab_size: int) -> None:
        """Raises a `ValueError` for a `depth` or `topk` the drafter cannot run with a model of text config `config`
        and `vocab_size` tokens: a round's steps attend in one `masked_attention` call each, of at most
        `MAX_QUERY_ROWS` query rows per key head (the cache's extension by the accepted path, `depth + 1` entries; each
        level's expansion, `topk` nodes; each entry once per query head of a key head)."""
        if depth < 1 or topk < 1:
            raise ValueError(f"MTPDrafter needs depth >= 1 and topk >= 1, got {depth} and {topk}")
        if topk > vocab_size:
            raise ValueError(
                f"bole_topk={topk} exceeds the vocabulary ({vocab_size} tokens): the MTP drafter gives every node "
                f"its topk likeliest tokens as children"
            )
        group = config.num_attention_heads // config.num_key_value_heads
        most = MAX_QUERY_ROWS // group
        for name, value, limit, what in (
            ("depth", depth, most - 1, "extends its cache by depth + 1 entries a round"),
            ("topk", topk, most, "expands topk nodes a level"),
        ):
            if value > limit:
                raise ValueError(
                    f"bole_{name}={value} is more than the MTP drafter takes on this model: it {what} in one attention "
                    f"call of at most {MAX_QUERY_ROWS} query rows per key head, and this model has {group} query heads "
                    f"per key head, so bole_{name} <= {limit}"
                )

    @classmethod
    def from_model(
        cls,
        model: PreTrainedModel,
        *,
        depth: int,
        topk: int,
        max_nodes: int | None = None,
        cuda_graphs: bool = False,
        compile: bool = False,
        fuse_projections: bool = False,
        pretrained: str | os.PathLike | None = None,
        state_dict: dict[str, torch.Tensor] | None = None,
    ) -> MTPDrafter:
        r"""
        The drafter for `model`, with the MTP head of its checkpoint.

        Args:
            model (`PreTrainedModel`):
                A Qwen3.5 or Qwen3.5-MoE model; its embedding, `lm_head` and rotary embedding are shared, not copied.
            depth, topk, max_nodes, cuda_graphs, compile, fuse_projections:
                See [`MTPDrafter`].
            pretrained (`str` or `os.PathLike`, *optional*):
                Checkpoint folder or Hub repo id holding the `mtp.*` weights; defaults to `model.name_or_path`.
            state_dict (`dict[str, torch.Tensor]`, *optional*):
                The `mtp.*` tensors themselves (checkpoint key layout).

        Raises:
            `ValueError`: the checkpoint has no `mtp.*` weights (use `bole_drafter="ngram"` then), or the drafter
            cannot run `depth` or `topk` on this model (`check_settings`).
        """
        vocab_size = model.get_output_embeddings().weight.shape[0]
        cls.check_settings(model.config.get_text_config(decoder=True), depth, topk, vocab_size)
        mtp = Qwen3_5MTP.from_pretrained(model, pretrained, state_dict=state_dict)
        return cls(
            mtp,
            model.get_input_embeddings(),
            model.get_output_embeddings(),
            model.get_decoder().rotary_emb,
            depth=depth,
            topk=topk,
            max_nodes=max_nodes,
            cuda_graphs=cuda_graphs,
            compile=compile,
            fuse_projections=fuse_projections,
        )

    @property
    def max_depth(self) -> int:
        """Levels below the root of every tree (`Drafter.max_depth`: reads no host-side sequences, so the loop may
        pipeline its rounds)."""
        return self.depth

    @property
    def max_tree_nodes(self) -> int:
        """The number of nodes drafted per row before capping: `topk + (depth - 1) * topk**2`."""
        return self.topk + (self.depth - 1) * self.topk**2

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> DraftTree:
        r"""
        Extends the cache with the entries committed since the last call, then drafts a tree from each row's root.

        Args:
            ctx (`DraftContext`):
                Reads `lengths` (row b holds `lengths[b] - 1` committed entries after this call), `max_length`,
                `max_nodes`, `hidden_states [B, A, hidden]`, `next_tokens [B, A]`, `new_mask [B, A]`
                (`None` = all real) and `positions [B, A]` (`None` = each entry's index in its row). A row whose new
                entries cover its whole sequence starts afresh; a row with no new entries gets a meaningless tree.

        Returns:
            `DraftTree` with `N = min(max_tree_nodes, ctx.max_nodes, max_nodes)` nodes per row, in descending order
            of cumulative draft probability; nodes whose cumulative probability underflows to 0 are padding (-inf).
        """
        if ctx.hidden_states is None or ctx.next_tokens is None:
            raise ValueError(
                "MTPDrafter needs DraftContext.hidden_states (the target's final hidden states) and next_tokens"
            )
        hidden = ctx.hidden_states.to(self.mtp.fc.weight.dtype)
        batch_size, num_new, _ = hidden.shape
        device = hidden.device
        new_mask = ctx.new_mask
        if new_mask is None:
            new_mask = torch.ones(batch_size, num_new, dtype=torch.bool, device=device)
        longest = ctx.max_length - 1  # on the host: at most this many entries per row after this call
        cache = self._reserve(batch_size, longest, device)
        committed = ctx.lengths.to(device) - 1  # [B] entries after this call
        positions = ctx.positions
        if positions is None:  # each entry's index in its row
            positions = committed[:, None] - new_mask.sum(1, keepdim=True) + new_mask.cumsum(1) - 1
        inputs = (hidden, ctx.next_tokens, new_mask, positions, committed)
        num_nodes = min(self.max_tree_nodes, ctx.max_nodes, self.max_nodes or ctx.max_nodes)
        # The head's twin with its projection groups fused (`models/twin.py`), or the head itself.
        twin = tree_twin(self.mtp, projections=self.fuse_projections, norms=False)
        with twin.entered() as self._head, attention_backends():  # not cuDNN: query and key lengths change every call
            cache.num_keys = cache.offset + longest  # attend over the slots in use only, not the whole capacity
            if not self._is_round(num_new):
                # A prompt: every entry but each row's last depth + 1 extends the cache first (eagerly, or in chunks
                # replayed from a graph: its length comes once), and those last ones go through a round's drafting,
                # replayed (or compiled) as every round's.
                inputs = self._extend_all_but_last(cache, inputs)
            if self._replays(device):
                return self._propose_graphed(cache, inputs, num_nodes)
            return DraftTree(*self._drafting()(cache, inputs, num_nodes))

    def _drafting(self):
        """`_round`, through `torch.compile` (made once) with `compile` set."""
        if not self.compile:
            return self._round
        if self._compiled_round is None:
            self._compiled_round = torch.compile(self._round)
        return self._run_compiled

    def _run_compiled(self, *args):
        """The compiled `_round` on `args`, allowed `_RECOMPILE_LIMIT` compiles in all; past them this drafter says
        so and drafts uncompiled from then on (rerunning `_round` rewrites the same slots with the same values)."""
        with torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True):
            try:
                return self._compiled_round(*args)
            except FailOnRecompileLimitHit:
                logger.warning(
                    f"hf_bole: the MTP drafter's rounds have compiled {_RECOMPILE_LIMIT} times in this process "
                    f"(every depth, topk and batch size compiles its own); this drafter (depth {self.depth}, topk "
                    f"{self.topk}) drafts uncompiled from now on, more slowly. bole_compile_drafter=False drafts "
                    f"uncompiled without this warning, or run fewer drafter shapes per process."
                )
                self._compiled_round = self._round
                return self._round(*args)

    def _round(
        self, cache: _MTPKVCache, inputs: tuple[torch.Tensor, ...], num_nodes: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`_extend` on `inputs` (its hidden, next tokens, mask, positions, committed), then `_draft`: the tree's
        tokens, parents and draft log-probabilities, each `[B, num_nodes]`."""
        root_hidden, root_position = self._extend(cache, *inputs)
        return self._draft(cache, root_hidden, root_position, inputs[-1], num_nodes)

    def _is_round(self, num_new: int) -> bool:
        # A round brings in its accepted path, at most depth + 1 entries; more is a prompt, drafted eagerly.
        return num_new <= self.depth + 1

    def _replays(self, device: torch.device) -> bool:
        return self.cuda_graphs and device.type == "cuda"

    def _reserve(self, batch_size: int, length: int, device: torch.device) -> _MTPKVCache:
        """The cache, reallocated for a new batch size or device, grown when `length` entries do not fit."""
        cache = self._cache
        if cache is None or cache.key.shape[0] != batch_size or cache.key.device != device:
            attn = self.mtp.layers[0].self_attn
            self._drop_graphs()  # they hold the old buffers' addresses
            cache = self._cache = _MTPKVCache(
                batch_size,
                self.mtp.config.num_key_value_heads,
                attn.head_dim,
                capacity=_round_up(length, _MTP_KV_GROWTH_STEP),
                scratch=self.topk * (self.depth - 1),
                dtype=self.mtp.fc.weight.dtype,
                device=device,
            )
        elif length > cache.capacity:
            self._drop_graphs()
            cache.grow(_round_up(max(length, 2 * cache.capacity), _MTP_KV_GROWTH_STEP))
        return cache

    def _drop_graphs(self) -> None:
        # The next capture starts a new memory pool: once the graphs of a pool are gone, CUDA refuses to capture
        # into it while any of its memory is still held (an internal assert in PyTorch's caching allocator).
        self._graphs.clear()
        self._extend_graphs.clear()
        self._graph_pool = None

    def _step(
        self,
        cache: _MTPKVCache,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
        slots: torch.Tensor,
        *,
        few_queries: bool,
        key_lengths: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One MTP forward of entries (hidden, token) `[B, T]` at rotary embedding `rope` (`_rope`'s), writing their
        keys/values to cache `slots [B, T]`; returns the outputs `[B, T, hidden]`. `few_queries`: a round's step, and
        `key_lengths [B]` the cache slots it reads of each row (see `mtp_attention`)."""
        cache.write_slots = slots
        # Under accelerate's device_map the target's embedding may run on another device than the head (which sits
        # with the LM head): its small output comes here (no copy on one device).
        embeds = self.embed_tokens(tokens).to(hidden.device)
        return self._head(
            embeds, hidden, rope, attention_mask=mask, past_key_values=cache, few_queries=few_queries,
            key_lengths=key_lengths,
        )  # fmt: skip

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's rotary embedding `(cos, sin)` at text positions `[B, T]`, each `[B, T, head_dim]`, on the
        positions' device (the head's) in the embedding's dtype, as the head's inputs have it."""
        # The rotary embedding reads only the dtype and device of its first argument.
        like = positions.new_empty(0, dtype=self.embed_tokens.weight.dtype)
        return tuple(t.to(positions.device) for t in self.rotary_emb(like, self.mtp.rotary_position_ids(positions)))

    def _best(self, x: torch.Tensor, log_softmax: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The `topk` largest of every row of `x [..., n]` (of its log-softmax with `log_softmax`): values float32,
        indices, each `[..., topk]`, descending."""
        if self.topk > MAX_K:
            return naive_row_topk(x, self.topk, log_softmax)
        return row_topk(x, self.topk, log_softmax)

    def _children(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The `topk` likeliest next tokens after the head's outputs `hidden [..., hidden_size]`: their draft
        log-probabilities and ids, each `[..., topk]`."""
        return self._best(self.lm_head(hidden), log_softmax=True)

    def _extend(
        self,
        cache: _MTPKVCache,
        hidden: torch.Tensor,
        next_tokens: torch.Tensor,
        new_mask: torch.Tensor,
        positions: torch.Tensor,
        committed: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes the new entries `[B, A]` (`positions`: their rotary positions) behind each row's earlier ones;
        returns the root output `[B, hidden]` and the root entry's position `[B]`."""
        batch_size, num_new = next_tokens.shape
        start = committed - new_mask.sum(1)  # [B] entries already cached
        index = start[:, None] + new_mask.cumsum(1) - 1  # [B, A] each entry's index in its row
        slots = torch.where(new_mask, cache.offset + index, cache.TRASH)
        positions = torch.where(new_mask, positions, 0)
        keys = torch.arange(cache.num_keys, device=slots.device)
        # [B, 1, A, L]: a real entry sees the row's entries up to itself; padding sees only the trash slot, so its
        # softmax stays finite without touching real entries
        mask = torch.where(
            new_mask[..., None], (keys <= slots[..., None]) & (keys >= cache.offset), keys == cache.TRASH
        )[:, None]
        tokens = torch.where(new_mask, next_tokens, 0)
        hidden = hidden.masked_fill(~new_mask[..., None], 0)
        few = self._is_round(num_new)
        out = self._step(
            cache, tokens, hidden, self._rope(positions), mask, slots, few_queries=few, key_lengths=cache.used(committed)
        )  # [B, A, hidden]
        last = torch.where(new_mask, torch.arange(num_new, device=slots.device), 0).amax(1)  # [B]
        rows = torch.arange(batch_size, device=slots.device)
        return out[rows, last], positions[rows, last]

    def _extend_all_but_last(self, cache: _MTPKVCache, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Writes each row's new entries `[B, A]` but its last `depth + 1` (`_extend`, whose inputs `inputs` are:
        hidden, next tokens, mask, positions, committed); returns `_extend`'s inputs for those last ones,
        `[B, depth + 1]`, right-aligned: a row with fewer new entries is padded on the left."""
        hidden, next_tokens, new_mask, positions, committed = inputs
        width = self.depth + 1
        batch_size, num_new = next_tokens.shape
        from_end = new_mask.flip(1).cumsum(1).flip(1)  # [B, A] the row's real entries at or after each one
        last = new_mask & (from_end <= width)
        extend = self._extend_replayed if self._replays(hidden.device) else self._extend
        extend(cache, hidden, next_tokens, new_mask & ~last, positions, committed - last.sum(1))
        # [B, A] each last entry's column in the tail; the others go to a spare column (width), dropped
        column = torch.where(last, width - from_end, width)
        source = torch.zeros(batch_size, width + 1, dtype=torch.long, device=column.device)
        source.scatter_(1, column, torch.arange(num_new, device=column.device).expand(batch_size, -1))
        mask = torch.zeros_like(source, dtype=torch.bool).scatter_(1, column, last)[:, :width]
        source = source[:, :width]  # [B, depth + 1] the columns of the tail's entries
        tail_hidden = hidden.gather(1, source[..., None].expand(-1, -1, hidden.shape[-1]))
        return tail_hidden, next_tokens.gather(1, source), mask, positions.gather(1, source), committed

    def _extend_replayed(
        self,
        cache: _MTPKVCache,
        hidden: torch.Tensor,
        next_tokens: torch.Tensor,
        new_mask: torch.Tensor,
        positions: torch.Tensor,
        committed: torch.Tensor,
    ) -> None:
        """`_extend` of a prompt's entries `[B, A]`, `_EXTEND_CHUNK` columns at a time, each chunk replayed from one
        CUDA graph per batch size (over the cache's whole length, as `_propose_graphed`'s). Eager, the extension
        launches about 130 kernels from Python, most of the drafter's first call on a small model; a chunk's replay
        is one launch."""
        B, A = next_tokens.shape
        pad = -A % _EXTEND_CHUNK
        hidden, next_tokens, new_mask, positions = (
            torch.cat([x, x.new_zeros(B, pad, *x.shape[2:])], dim=1) for x in (hidden, next_tokens, new_mask, positions)
        )  # [B, A + pad], padding entries masked out
        chunks = new_mask.view(B, -1, _EXTEND_CHUNK)  # [B, chunks, C]
        # [B, chunks] each row's entries once a chunk is in
        after = committed[:, None] - new_mask.sum(1, keepdim=True) + chunks.sum(2).cumsum(1)
        cache.num_keys = cache.key.shape[2]
        for j in range(chunks.shape[1]):
            columns = slice(j * _EXTEND_CHUNK, (j + 1) * _EXTEND_CHUNK)
            inputs = (*(x[:, columns] for x in (hidden, next_tokens, new_mask, positions)), after[:, j])
            graphed = self._extend_graphs.get(B)
            if graphed is None:
                static = tuple(x.clone() for x in inputs)

                def run(static=static) -> None:
                    # Writing the same entries again rewrites the same slots with the same values: `capture` may run
                    # it twice.
                    self._extend(cache, *static)

                graph, _ = capture(run, hidden.device, self._graph_pool)
                self._graph_pool = graph.pool()
                graphed = self._extend_graphs[B] = (graph, static)
            for buffer, value in zip(graphed[1], inputs):
                buffer.copy_(value)
            graphed[0].replay()

    def _propose_graphed(self, cache: _MTPKVCache, inputs: tuple[torch.Tensor, ...], num_nodes: int) -> DraftTree:
        """`_round` (compiled with `compile`), replayed from a CUDA graph captured once per (batch size, new entries,
        `num_nodes`) and cache buffers; `inputs` are `_extend`'s (hidden, next tokens, mask, positions, committed).

        Shapes must not change between replays, so attention covers the cache's whole length rather than the slots
        in use: the extra slots are masked out and add exactly zero."""
        cache.num_keys = cache.key.shape[2]
        hidden = inputs[0]
        key = (hidden.shape[0], hidden.shape[1], num_nodes)
        graphed = self._graphs.get(key)
        if graphed is None:
            static = tuple(x.clone() for x in inputs)
            drafting = self._drafting()

            def run() -> DraftTree:
                # Writing the same entries again rewrites the same slots with the same values, and `_draft` writes
                # only the tree's scratch slots: the pair may run twice, as `capture` does.
                return DraftTree(*drafting(cache, static, num_nodes))

            graph, tree = capture(run, hidden.device, self._graph_pool)
            self._graph_pool = graph.pool()
            graphed = self._graphs[key] = _GraphedDraft(graph, static, tree)
        for buffer, value in zip(graphed.inputs, inputs):
            buffer.copy_(value)
        graphed.graph.replay()
        out = graphed.tree  # the graph's own buffers, overwritten by the next replay: hand out copies
        return DraftTree(tokens=out.tokens.clone(), parents=out.parents.clone(), draft_logprobs=out.draft_logprobs.clone())

    def _draft(
        self,
        cache: _MTPKVCache,
        root_hidden: torch.Tensor,
        root_position: torch.Tensor,
        committed: torch.Tensor,
        num_nodes: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Grows the tree level by level from the root outputs `[B, hidden]`, then keeps the best `num_nodes`: their
        tokens, parents and draft log-probabilities, each `[B, num_nodes]` (a `DraftTree`'s fields)."""
        K = self.topk
        batch_size, hidden_size = root_hidden.shape
        device = root_hidden.device
        keys = torch.arange(cache.num_keys, device=device)
        key_lengths = cache.used(committed)  # [B]
        committed_keys = ((keys >= cache.offset) & (keys < key_lengths[:, None]))[:, None, :]  # [B, 1, L]

        levels = TopkLevels(*self._children(root_hidden))  # the root's children, [B, K]
        frontier_hidden = root_hidden[:, None].expand(-1, K, -1)  # [B, K, hidden]
        frontier_tokens = levels.tokens[0]
        frontier_ancestors = torch.zeros(batch_size, K, cache.num_keys, dtype=torch.bool, device=device)
        # Every node of level d sits at position root_position + d: the rotary embedding of all levels at once (one
        # computation a round instead of one a level), each [B, depth - 1, head_dim]
        cos, sin = self._rope(root_position[:, None] + torch.arange(1, self.depth, device=device))
        for d in range(1, self.depth):
            slots = cache.TRASH + 1 + (d - 1) * K + torch.arange(K, device=device)  # [K] scratch slots of level d
            frontier_ancestors = frontier_ancestors | (keys == slots[:, None])  # [B, K, L] ancestors and self
            out = self._step(
                cache,
                frontier_tokens,
                frontier_hidden,
                (cos[:, d - 1 : d].expand(-1, K, -1), sin[:, d - 1 : d].expand(-1, K, -1)),
                (committed_keys | frontier_ancestors)[:, None],
                slots.expand(batch_size, -1),
                few_queries=True,
                key_lengths=key_lengths,
            )  # [B, K, hidden]
            levels.add(*self._children(out))  # [B, K, K]
            if d + 1 < self.depth:
                chosen = levels.advance(self._best)  # [B, K] among the level's K*K children
                parent = chosen // K  # index of the parent in the current frontier
                frontier_tokens = levels.tokens[-1].gather(1, chosen)
                frontier_hidden = out.gather(1, parent[..., None].expand(-1, -1, hidden_size))
                frontier_ancestors = frontier_ancestors.gather(1, parent[..., None].expand(-1, -1, cache.num_keys))

        return levels.best_nodes(num_nodes)


@dataclass
class _GraphedDraft:
    graph: torch.cuda.CUDAGraph
    # `_extend`'s: hidden [B, A, hidden]; next tokens, mask, positions [B, A]; committed [B]
    inputs: tuple[torch.Tensor, ...]
    tree: DraftTree  # its outputs


class _MTPKVCache:
    """Keys/values of the MTP layer, `[B, kv_heads, 1 + scratch + capacity, head_dim]`: slot 0 is a trash slot that
    padding entries are written to, the next `scratch` slots hold the draft tree's entries, and the committed entries
    follow from `offset` on (row b's first `committed[b]`). Committed entries go last so that attention can stop at
    the longest row (`num_keys`). Buffers start at zero: a masked-out slot must hold finite values, or SDPA's
    `0 * NaN` would leak into real rows.

    Implements the one `Cache` method the attention layer calls, `update`, writing to `write_slots [B, T]`."""

    TRASH = 0

    def __init__(
        self,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        capacity: int,
        scratch: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.capacity, self.offset = capacity, 1 + scratch
        shape = (batch_size, num_kv_heads, self.offset + capacity, head_dim)
        self.key = torch.zeros(shape, dtype=dtype, device=device)
        self.value = torch.zeros(shape, dtype=dtype, device=device)
        self.num_keys = self.offset
        self.write_slots: torch.Tensor | None = None

    def used(self, committed: torch.Tensor) -> torch.Tensor:
        """`[B]` each row's slots in use, trash and scratch included, for rows of `committed [B]` entries: a round's
        attention reads no slot past them (under CUDA graphs `num_keys` is the whole capacity)."""
        return self.offset + committed

    def grow(self, capacity: int) -> None:
        """Reallocates with a larger committed capacity, keeping the committed entries."""
        B, H, L, D = self.key.shape
        for name in ("key", "value"):
            new = self.key.new_zeros(B, H, self.offset + capacity, D)
            new[:, :, :L] = getattr(self, name)
            setattr(self, name, new)
        self.capacity = capacity

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        index = self.write_slots[:, None, :, None].expand(-1, key_states.shape[1], -1, key_states.shape[3])
        self.key.scatter_(2, index, key_states)
        self.value.scatter_(2, index, value_states)
        return self.key[:, :, : self.num_keys], self.value[:, :, : self.num_keys]


def _round_up(n: int, step: int) -> int:
    return max(step, -(-n // step) * step)
