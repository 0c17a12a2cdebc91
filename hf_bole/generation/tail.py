"""A round's work after its verify forward: commit each row's accepted path and hand the drafter what it has not seen.

On the host it is about twenty launches of small kernels (the acceptance kernel, the KV move, the stacked GDN commit,
the conv windows, the drafter's next inputs), more Python than GPU work. Greedy acceptance without logits processors reads nothing but the
verify forward's logits, so `greedy_tail` (acceptance included) replays from one CUDA graph
(`hf_bole.generation.graphs.TailGraphs`); sampling and processors accept eagerly and then run `round_tail`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_bole.cache import BoleCache
from hf_bole.generation.accept_kernel import accept_greedy_kernel
from hf_bole.generation.acceptance import Acceptance
from hf_bole.generation.tree import VerifyTree
from hf_bole.models import TreeForwardOutput


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
) -> RoundTail:
    """Commits `accepted`'s paths of the `active [B]` rows (at most `step` nodes each) of the verify forward `out`'s
    tree round and gathers the drafter's next inputs from its `hidden_states [B, T, hidden]`: to `width` columns (a drafter with `max_depth`,
    whose inputs then keep one shape from round to round), or as wide as the paths with `width=None`. Reads nothing
    on the host."""
    hidden_states = out.hidden_states
    path = torch.where(active[:, None], accepted.path[:, :step], -1)  # [B, <= step]
    positions = cache.positions.to(hidden_states.device, copy=True)  # [B] before the commit
    # paths of the acceptance walk: no host read of them
    cache.commit(out.tree_round, path.to(cache.device), check_values=False)
    committed_width = path.shape[1]
    width = committed_width if width is None else width
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
) -> RoundTail:
    """Greedy acceptance of `verify` from the verify forward's logits (`out.logits [B, T, V]`; no logits processors),
    then `round_tail`. Greedy reads only the argmax: taken on the logits themselves, no fp32 copy of them."""
    accepted = accept_greedy_kernel(verify, out.logits.argmax(-1))
    return round_tail(cache, out, accepted, active, step, width)
