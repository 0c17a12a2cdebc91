"""Continuing from a cache (`past_key_values=`, or `cache=` from transformers 5.24), and the cache a call hands back.

As with plain `generate`, `input_ids` holds the whole conversation and the cache its first L tokens: only the rest is
prefilled (`Continuation`). The cache may be a `BoleCache` an earlier hf_bole call returned or a transformers
`DynamicCache` of the model (plain `generate`'s, or a plain forward's over a prefix); its state is copied into the
call's own cache, never recomputed. A cache of one row given to a batch of several is a prefix all rows share: each
row's first L tokens after its left padding are the cached ones, and each row starts from a copy of the state.

At the end the call's cache is brought to exactly `out.sequences` minus its last token, as plain `generate` leaves its
own (`settle`): rows that stopped early hold their EOS and the padding after it too. The commits keep every row at or
before that point during decoding (`commit.RowEnds` cuts paths at a row's EOS and at the length limit), so settling
appends the tokens a row still lacks and never rolls back, which a GDN state cannot; a row a stop string or a stopping
criterion cut inside a round, after the round committed past it, is prefilled again (those rows only). The caller's
cache is then updated in place (`hand_back`), as transformers updates a cache it is given; a shared prefix is left as
it was.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import Cache

from hf_bole.cache import BoleCache
from hf_bole.cache.state import CacheState, read_dynamic, write_dynamic
from hf_bole.generation.prefill import chain_prefill, plain_prefill

# The names `generate` takes a cache by (5.17-5.25): `cache` from 5.24, which renames the other two to it.
CACHE_ARGS = ("cache", "past_key_values", "cache_params")


def check_cache_args(kwargs: dict) -> None:
    """Refuses a cache passed by two names at once among `generate`'s keyword arguments `kwargs` (transformers 5.24
    would keep `cache=` and drop the other with a warning)."""
    given = [name for name in CACHE_ARGS if kwargs.get(name) is not None]
    if len(given) > 1:
        raise ValueError(
            f"a cache is passed twice, as {' and '.join(f'{n}=' for n in given)}: pass it once (cache= from "
            f"transformers 5.24, past_key_values= before)"
        )


def given_cache(model_kwargs: dict) -> Cache | None:
    """The cache the caller passed to `generate`, if any: `generate` puts one of its own among the model kwargs when
    none is given, under `cache` (5.24 on) or `past_key_values`; the caller's carries `_is_user_defined`."""
    check_cache_args(model_kwargs)
    for name in CACHE_ARGS:
        value = model_kwargs.get(name)
        if isinstance(value, Cache) and getattr(value, "_is_user_defined", False):
            return value
    return None


@dataclass
class Continuation:
    """A call continuing from the caller's cache `given`, whose state is `state` (`L` slots).

    Row b's cached slots are its columns `[starts[b], starts[b] + L)` of `input_ids`: from 0 for a cache of the call's
    rows, after the row's left padding for a shared prefix (`shared`: one row for several).
    """

    given: Cache
    state: CacheState
    starts: list[int]
    shared: bool

    @property
    def length(self) -> int:
        return self.state.length

    @property
    def first(self) -> int:
        """The first column any row prefills."""
        return min(self.starts) + self.length

    @property
    def aligned(self) -> bool:
        """Every row's cached slots end at one column (a plain forward can prefill the rest of all rows at once)."""
        return len(set(self.starts)) == 1

    def uncached(self, mask: torch.Tensor) -> torch.Tensor:
        """`[B, P - first]` bool: the tokens of `mask` (`[B, P]`, True at tokens) that the prefill runs, those after
        each row's cached ones, in columns `first` on."""
        columns = torch.arange(self.first, mask.shape[1], device=mask.device)
        ends = torch.tensor(self.starts, device=mask.device)[:, None] + self.length
        return mask[:, self.first :] & (columns >= ends)


def continuation(cache: Cache, config, input_ids: torch.Tensor, mask: torch.Tensor, max_length: int) -> Continuation:
    """What a call of `input_ids` (`[B, P]`, `mask` True at their tokens) continues from `cache` (the caller's, of a
    model of text config `config`), checked: a cache of another model, shape, batch size or dtype, one holding all of
    `input_ids` or more, one whose slots disagree with `input_ids` or the mask, or a `BoleCache` too small to hold the
    call's tokens raise a ValueError saying so."""
    if isinstance(cache, BoleCache):
        state = cache.state()
        if cache.max_cache_len is not None and cache.max_cache_len < max_length - 1:
            raise ValueError(
                f"the BoleCache holds max_cache_len={cache.max_cache_len} slots a row, but this call may need "
                f"{max_length - 1} (its max_length - 1): pass a cache made with max_cache_len=None (it grows), or a "
                f"shorter max_new_tokens"
            )
    else:
        state = read_dynamic(cache, config)
    B, P = input_ids.shape
    L = state.length
    if L >= P:
        raise ValueError(
            f"the cache holds {L} tokens but input_ids only {P}: input_ids holds the whole conversation, the cache its "
            f"first tokens, and at least the last token must be new (its logits choose the first generated one); "
            f"pass input_ids that continue the cached tokens"
        )
    shared = L > 0 and state.batch_size == 1 and B > 1
    if L > 0 and not shared and state.batch_size != B:
        raise ValueError(
            f"the cache holds {state.batch_size} rows, but input_ids has {B}: pass a cache of {B} rows, or of one "
            f"row (a prefix every row shares)"
        )
    if not shared:
        ids, held = input_ids[:, :L], state.token_ids
        # only where the cache holds tokens: padding may be written with another id
        if held is not None and bool(((ids != held.to(ids.device)) & state.valid.to(ids.device)).any()):
            raise ValueError(_TOKENS_ERROR)
        if state.valid is not None and bool((mask[:, :L] & ~state.valid.to(mask.device)).any()):
            raise ValueError(
                "the attention mask marks as tokens slots the cache holds as padding: the cached columns of the "
                "attention mask must keep the padding the cache was made with"
            )
        return Continuation(cache, state, [0] * B, shared)
    # A shared prefix: every row's first L tokens after its left padding.
    if state.valid is not None and not bool(state.valid.all()):
        raise ValueError("a cache of one row shared by a batch must hold no padding")
    pad = (~mask).long().cumprod(-1).sum(-1)  # [B] each row's left padding
    starts = pad.tolist()
    columns = torch.arange(P, device=mask.device)
    prefix = (columns >= pad[:, None]) & (columns < pad[:, None] + L)  # [B, P]
    if any(s + L >= P for s in starts) or bool((prefix & ~mask).any()):
        raise ValueError(
            f"a cache of one row shared by a batch holds the first {L} tokens of every row: each row needs those {L} "
            f"tokens after its left padding, and at least one more"
        )
    if state.token_ids is not None:
        rows = input_ids[prefix].view(B, L)
        if not bool((rows == state.token_ids.to(rows.device)).all()):
            raise ValueError(_TOKENS_ERROR)
    return Continuation(cache, state, starts, shared)


_TOKENS_ERROR = (
    "input_ids do not start with the tokens this BoleCache holds: pass the conversation it holds (an earlier call's "
    "out.sequences) followed by the new tokens. (With CUDA graphs the cache an hf_bole call returns is kept for the "
    "model's next call of the same batch size, which starts it afresh: copy.deepcopy(out.past_key_values) keeps it.)"
)


def load(continued: Continuation, cache: BoleCache, mask: torch.Tensor) -> None:
    """Copies the state `continued` starts from into the call's `cache` (nothing to do where it is that cache): the
    cached slots' padding as the call's `mask` (`[B, P]`) says, a shared prefix's all tokens."""
    if continued.given is cache:
        return
    valid = None if continued.shared else mask[:, : continued.length]
    cache.load(continued.state, continued.starts, valid)


def settle(model, cache: BoleCache, forward, commit, written: torch.Tensor, sequences: torch.Tensor, plan) -> None:
    """Brings the call's `cache` to exactly `sequences` (`[B, P + T]`, the output) minus its last column, as plain
    `generate` leaves its cache: appends what each row lacks (a row that stopped at EOS: the EOS and the padding after
    it, which plain decoding runs too) as chains through `forward`, committed by `commit` (`chain_prefill`'s), and
    records the token ids. One host read of the rows' lengths.

    A row whose commits went past the output (cut inside a round by a stop string or a stopping criterion the commit
    cannot see, after the round committed its path) cannot be rolled back: its conversation is prefilled again, those
    rows alone, by transformers' forward of `model` into a cache of their own (with the prompt's mask and position ids,
    each generated token counted on from the prompt's last position, as plain `generate` runs them), whose state then
    replaces theirs (`BoleCache.load_rows`); the other rows keep theirs. They run in one forward, as plain `generate`
    would prefill that conversation: it computes no logits, so it holds no more than the prefill of a next call
    continuing without a cache.

    Args:
        written: `[B, >= held]` the tokens the device generated per row after the prompt's `P` columns (the writes'
            sequences), which the rows' commits followed.
        plan: the call's `CallPlan` (its prompt's mask and position ids, its pad token, where the prompt goes in).
    """
    mask, pad_token = plan.mask, plan.pad_token
    target = sequences.shape[1] - 1
    held = cache.lengths.to(sequences.device)  # [B] slots each row holds
    P = mask.shape[1]
    # Every row holds a prefix of its output: no more slots than it, and the tokens the output kept.
    width = min(int(held.max()), target)
    unheld = torch.arange(P, width, device=held.device) >= held[:, None]  # [B, width - P]
    past = (held > target) | ~((written[:, P:width] == sequences[:, P:width]) | unheld).all(-1)  # [B]
    if bool(past.any()):
        rows = past.nonzero()[:, 0]
        # The generated tokens are tokens (plain decoding runs the padding after a stop too), numbered on from the
        # prompt's last position in every rotary row, as `generate` extends the position ids it is given.
        generated = target - P
        attention_mask = torch.cat([mask[rows], mask.new_ones(len(rows), generated)], dim=1).long()  # [n, target]
        prompt_positions = plan.position_ids[..., rows, :]  # [n, P] (or [4, n, P], mRoPE)
        steps = torch.arange(1, generated + 1, device=prompt_positions.device)
        position_ids = torch.cat([prompt_positions, prompt_positions[..., -1:] + steps], dim=-1)  # [..., n, target]
        refilled = BoleCache.for_model(model, len(rows))
        refilled.reserve(target)
        plain_prefill(model, refilled, sequences[rows, :target], attention_mask, position_ids, plan.in_device)
        cache.load_rows(rows, refilled.state(), refilled.positions)
        held = cache.lengths.to(sequences.device)
    lowest = int(held.min())
    if lowest < target:
        columns = torch.arange(lowest, target, device=held.device)
        chain_prefill(forward, cache, sequences[:, lowest:target], columns >= held[:, None], pad_token, commit)
    cache.token_ids = sequences[:, :target].clone()


def hand_back(continued: Continuation | None, cache: BoleCache, config) -> Cache:
    """The cache a call returns (`out.past_key_values`), settled: the caller's, made to hold the call's `cache` in
    place (a `DynamicCache` refilled, a `BoleCache` loaded), as transformers updates a cache it is given; the call's
    own without one, or for a shared prefix (left as it was)."""
    if continued is None or continued.shared or continued.given is cache:
        return cache
    given, state = continued.given, cache.state()
    if isinstance(given, BoleCache):
        given.load(state)
        given.token_ids = cache.token_ids
    else:
        write_dynamic(state, given, config)
    return given
