"""Step 5 of a round, commit: each row's accepted path of the verified tree round enters the cache
(`BoleCache.commit`), and what the drafter has not seen yet is gathered for the next round.

On the host it is about twenty launches of small kernels (the KV move, the stacked GDN commit, the conv windows, the
drafter's next inputs), more Python than GPU work. Greedy acceptance without logits processors reads nothing but the
verify forward's logits, so with `bole_cuda_graphs` acceptance and commit replay from one CUDA graph (`GreedyTail`,
`TailGraphs`); otherwise `Commit` runs `round_tail` after step 4's acceptance.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_bole.cache import BoleCache
from hf_bole.generation import graphs
from hf_bole.generation.accept import greedy_accept
from hf_bole.generation.acceptance import Acceptance
from hf_bole.generation.stopping import cached_arange
from hf_bole.generation.tree import VerifyTree
from hf_bole.models import TreeForwardOutput


@dataclass(frozen=True)
class RowEnds:
    """Where commits stop a row, for a call that hands its cache back (`continuation.settle` brings it to the output's
    tokens, which a GDN state cannot be rolled back to): at `limit` slots (the call's max_length - 1), and at a row's
    first token of `eos`, whose parent is the last node it commits; the row commits nothing more after that."""

    eos: tuple[int, ...]
    limit: int

    def tensors(self, batch_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """`(limits [B], eos [E])` on `device` for `round_tail`: the slots each row may hold, which it lowers at a row's
        EOS, and the EOS ids."""
        limits = torch.full((batch_size,), self.limit, dtype=torch.long, device=device)
        return limits, torch.tensor(self.eos, dtype=torch.long, device=device)


def cut_at_ends(path: torch.Tensor, accepted: Acceptance, lengths: torch.Tensor, limits: torch.Tensor,
                eos: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """`path` (`[B, L]`, on the cache's device, rows holding `lengths [B]` slots) without the nodes past where each
    row ends: past `limits [B]` slots, which a row's first emitted token of `eos` (`[E]`) lowers (in place) to end it
    after that token's parent: the output keeps the EOS, the cache everything before it. Reads nothing on the host."""
    if eos.numel() > 0:
        tokens = accepted.tokens.to(path.device)  # [B, T]
        steps = cached_arange(tokens.shape[1], path.device)
        emitted = steps < accepted.accept_lengths.to(path.device)[:, None]  # [B, T]
        hit = (tokens[..., None] == eos).any(-1) & emitted  # a few EOS ids: compared one by one
        # [B] nodes up to the first EOS's parent: the EOS's index + 1, or no end
        first = torch.where(hit, cached_arange(tokens.shape[1], path.device, 1), _NO_END).amin(1)
        torch.minimum(limits, lengths + first, out=limits)
    return torch.where(cached_arange(path.shape[1], path.device) < (limits - lengths)[:, None], path, -1)


# More slots than any row holds.
_NO_END = 2**40


@dataclass
class RoundTail:
    """What a round leaves for the host and for the next round."""

    tokens: torch.Tensor  # [B, T] the emitted tokens of each row (`Acceptance.tokens`)
    lengths: torch.Tensor  # [B] how many of them count: the accepted length, 0 for a row that sat the round out
    root: torch.Tensor  # [B] the next round's root, the bonus token
    # What the drafter has not seen: the accepted paths' entries, right-padded (mask False), [B, width] (hidden
    # [B, width, hidden])
    hidden: torch.Tensor
    next_tokens: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor
    committed_width: int  # the width of the committed paths (`BoleCache.record_commit`)


def round_tail(
    cache: BoleCache,
    out: TreeForwardOutput,
    accepted: Acceptance,
    active: torch.Tensor,
    step: int,
    width: int | None,
    ends: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> RoundTail:
    """Commits `accepted`'s paths of the `active [B]` rows (at most `step` nodes each, cut where rows end with `ends`:
    `RowEnds.tensors`, see `cut_at_ends`) of the verify forward `out`'s tree round and gathers the drafter's next
    inputs from its `hidden_states [B, T, hidden]`: to `width` columns, or to the tree's `T` where narrower (a drafter
    with `max_depth`, whose inputs then keep one shape from round to round of one width: one column after a round of
    the roots alone), or as wide as the paths with `width=None`. Reads nothing on the host."""
    hidden_states = out.hidden_states
    path = torch.where(active[:, None], accepted.path[:, :step], -1)  # [B, <= step]
    positions = cache.positions.to(hidden_states.device, copy=True)  # [B] before the commit
    committed = path.to(cache.device)
    if ends is not None:
        committed = cut_at_ends(committed, accepted, cache.lengths, *ends)
    # paths of the acceptance walk: no host read of them
    cache.commit(out.tree_round, committed, check_values=False)
    committed_width = path.shape[1]
    width = committed_width if width is None else min(width, committed_width)
    path = torch.nn.functional.pad(path, (0, width - committed_width), value=-1)  # [B, width]
    hidden = hidden_states.gather(1, path.clamp(min=0)[..., None].expand(-1, -1, hidden_states.shape[-1]))
    next_tokens = accepted.tokens[:, :width].clamp(min=0)
    next_tokens = torch.nn.functional.pad(next_tokens, (0, width - next_tokens.shape[1]))
    return RoundTail(
        tokens=accepted.tokens,
        lengths=torch.where(active, accepted.accept_lengths, 0),
        root=accepted.bonus,
        hidden=hidden,
        next_tokens=next_tokens,
        mask=path >= 0,
        positions=positions[:, None] + torch.arange(width, device=path.device),
        committed_width=committed_width,
    )


def greedy_tail(
    cache: BoleCache,
    verify: VerifyTree,
    out: TreeForwardOutput,
    active: torch.Tensor,
    step: int,
    width: int | None,
    ends: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> RoundTail:
    """Greedy acceptance of `verify` from the verify forward's logits (`out.logits [B, T, V]`; no logits processors),
    then `round_tail`. Greedy reads only the argmax: taken on the logits themselves, no fp32 copy of them."""
    accepted = greedy_accept(verify, out.logits.argmax(-1))
    return round_tail(cache, out, accepted, active, step, width, ends)


class Commit:
    """Step 5 after an acceptance of its own (step 4): `commit(verified, accepted, active)` is `round_tail` with the
    call's `step` and `width` (the most nodes a round commits per row; the drafter's inputs' width, None for as wide
    as the paths), its paths cut where rows end with `ends`."""

    def __init__(self, cache: BoleCache, step: int, width: int | None, ends: RowEnds | None = None):
        self.cache, self.step, self.width = cache, step, width
        self.ends = None if ends is None else ends.tensors(cache.batch_size, cache.device)

    def __call__(self, verified, accepted: Acceptance, active: torch.Tensor) -> RoundTail:
        return round_tail(self.cache, verified.out, accepted, active, self.step, self.width, self.ends)


class GreedyTail:
    """Steps 4 and 5 of greedy decoding without logits processors under CUDA graphs: the acceptance kernel, the commit
    and the drafter's next inputs replay from one graph (`TailGraphs`). Step 4 (`accept`) launches nothing and leaves
    the acceptance to step 5 (`commit`), which replays the graph; its paths are cut where rows end with `ends`."""

    def __init__(self, tails: TailGraphs, step: int, width: int | None, ends: RowEnds | None = None):
        self.tails, self.step, self.width, self.ends = tails, step, width, ends
        tails.begin(ends)

    def accept(self, verified, n_gen: list[int]) -> None:
        return None

    def commit(self, verified, accepted: None, active: torch.Tensor) -> RoundTail:
        return self.tails(verified.tree, verified.out, active, self.step, self.width, self.ends)


class TailGraphs:
    """`greedy_tail(cache, verify, logits, hidden_states, active, step, width, ends)` replayed from a CUDA graph per
    (input buffers, step, width): the acceptance kernel, the commit's kernels and the drafter's next inputs, about
    twenty launches and their checks in Python (0.6 ms of host time a round), in one replay.

    The graph reads its inputs where they are, so they must be buffers that keep their addresses: the selection
    graphs' trees (`select.SelectGraphs`) and the verify graphs' outputs (`verify.VerifyGraphs`) of the cache; a graph
    is made per combination of them (a few budgets and widths), and `active` is copied in. It writes the cache's state
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
        # `RowEnds.tensors` the graphs read where they are: one `limits` for every call (set by `begin`), one `eos`
        # per set of EOS ids.
        self._limits: torch.Tensor | None = None
        self._eos: dict[tuple[int, ...], torch.Tensor] = {}

    def clear(self) -> None:
        """Forgets every graph (the cache's storage changed)."""
        self._graphs.clear()
        self._seen.clear()
        self._pool = None

    def begin(self, ends: RowEnds | None) -> None:
        """Sets the rows' limits for a call whose paths are cut where rows end with `ends` (None: not cut)."""
        if ends is None:
            return
        limits, eos = ends.tensors(self.cache.batch_size, self.cache.device)
        if self._limits is None:
            self._limits = limits
        self._limits.copy_(limits)
        self._eos.setdefault(ends.eos, eos)

    def __call__(
        self,
        verify: VerifyTree,
        out: TreeForwardOutput,
        active: torch.Tensor,
        step: int,
        width: int | None,
        ends: RowEnds | None = None,
    ) -> RoundTail:
        # The verify graph's outputs: a round of its own per graph, which their addresses name too.
        inputs = (verify.input_ids, verify.parents, verify.depths, verify.node_mask, out.logits, out.hidden_states)
        key = (
            tuple((x.data_ptr(), x.shape, x.stride(), x.dtype) for x in inputs), active.shape, step, width,
            None if ends is None else ends.eos,
        )  # fmt: skip
        cut = None if ends is None else (self._limits, self._eos[ends.eos])
        entry = self._graphs.get(key)
        if entry is None:
            if key not in self._seen:
                self._seen.add(key)
                return greedy_tail(self.cache, verify, out, active, step, width, cut)
            static_active = active.clone()
            # Not warmed up: the tail writes the cache. The capture runs the commit's host-side record once, which
            # the replay below is the commit of.
            graph, tail = graphs.capture(
                lambda: greedy_tail(self.cache, verify, out, static_active, step, width, cut),
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
    """`cache.commit(tree_round, path, check_values=False)` replayed from a CUDA graph per (path shape, tree round):
    the prefill chains' commits (`generation/prefill.py`), whose paths are whole chains. Launched from Python a commit
    is about a dozen launches, three of them Triton kernels; with the chain's other launches it kept the host busier
    than the GPU on a small model.

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

    def __call__(self, tree_round, path: torch.Tensor) -> None:
        """Commits `path [B, L]` of `tree_round` (a verify graph's), as `BoleCache.commit` does without reading it."""
        key = (tuple(path.shape), id(tree_round))
        entry = self._graphs.get(key)
        if entry is None:
            if key not in self._seen:
                self._seen.add(key)
                self.cache.commit(tree_round, path, check_values=False)
                return
            static = path.clone()
            commit = lambda: self.cache.commit(tree_round, static, check_values=False)  # noqa: E731
            graph, _ = graphs.capture_queued(commit, path.device)
            self._graphs[key] = (graph, static, tree_round)
            graph.replay()
            return
        graph, static, _ = entry
        static.copy_(path)
        graph.replay()
        self.cache.record_commit(path.shape[1])
