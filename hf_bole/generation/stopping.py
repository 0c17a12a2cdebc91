"""Plain `generate`'s stopping rules for rows that advance several tokens a round: EOS and length on the host, stop
strings on the device over each row's last tokens, other criteria token by token."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
)


class Stopping:
    """Plain `generate`'s stopping rules applied token by token to rows that advance at different speeds.

    EOS and length criteria are checked on the host from the emitted token ids. Stop strings look only at the last
    `maximum_token_len` tokens of a row: `suffix_stops` checks every new token of every row in one call per round
    over those windows. Any other criterion (user criteria) is called exactly as plain decoding calls it, with the
    row's full `input_ids`, token by token.
    """

    def __init__(self, criteria: StoppingCriteriaList, prompt_length: int):
        self.max_lengths = [c.max_length for c in criteria if isinstance(c, MaxLengthCriteria)]
        # one host read per criterion (the ids sit on the device), not one per id
        self.eos = {t for c in criteria if isinstance(c, EosTokenCriteria) for t in c.eos_token_id.flatten().tolist()}
        others = [c for c in criteria if not isinstance(c, (MaxLengthCriteria, EosTokenCriteria))]
        suffix = [c for c in others if isinstance(c, StopStringCriteria)]
        self.window = max((c.maximum_token_len for c in suffix), default=0)
        # A window reaching before the first column would see tokens plain decoding's shorter input_ids lack: with
        # prompts shorter than the longest stop string, those criteria are called token by token too.
        self.suffix = suffix if prompt_length + 1 >= self.window else []
        self.others = StoppingCriteriaList([c for c in others if not any(c is s for s in self.suffix)])
        # Plain decoding pads a finished row only when some criterion knows an EOS token (`_sample`).
        self.pads_finished = any(hasattr(c, "eos_token_id") for c in criteria)

    def first_stop(self, tokens: list[int], length: int, suffix: list[int] | None, row_ids) -> int | None:
        """The index of the first of a row's new `tokens` after which it stops, or None: its sequence is `length`
        long before them, `row_ids(n)` gives its first `n` ids as [1, n], and `suffix[j]` is what `suffix_stops`
        said of token j (None without stop strings). Other criteria are called token by token with the row's ids, as
        plain decoding calls them, up to the stop."""
        reach = min((m - length - 1 for m in self.max_lengths), default=len(tokens))  # the token reaching a length
        for j, token in enumerate(tokens):
            if j >= reach or token in self.eos or (suffix is not None and suffix[j]):
                return j
            if self.others and bool(self.others(row_ids(length + j + 1), None).any()):
                return j
        return None

@dataclass(frozen=True, eq=False)
class StopTables:
    """What a `StopStringCriteria` computes with, taken before its first call moves the tensors to the device.
    transformers makes the tables once per vocabulary and stop strings and hands each criterion built from them the
    same tensors (5.24: keyed by the sorted vocabulary), so `match` mostly compares identities; where the key missed
    (5.17 keys by the tokenizer's vocabulary order, which a fast tokenizer changes between instances) it compares
    contents on the host, about 0.7 ms for a 248k vocabulary (a capture of the writes costs more)."""

    embedding_vec: torch.Tensor | None  # [vocab + 2, positions]; None for criteria of other types (never matched)
    scalars: tuple

    @classmethod
    def of(cls, criterion) -> StopTables:
        if type(criterion) is not StopStringCriteria:
            return cls(None, ())
        return cls(criterion.embedding_vec, cls._scalars(criterion))

    @staticmethod
    def _scalars(c: StopStringCriteria) -> tuple:
        return (c.maximum_token_len, c.num_stop_strings, c.max_valid_positions, c.max_valid_end_lens,
                tuple(c.target_lens.tolist()))  # fmt: skip

    def match(self, criterion) -> bool:
        if self.embedding_vec is None or type(criterion) is not StopStringCriteria:
            return False
        if self._scalars(criterion) != self.scalars:
            return False
        kept, new = self.embedding_vec, criterion.embedding_vec
        same_layout = (new.device, new.shape, new.dtype) == (kept.device, kept.shape, kept.dtype)
        return new is kept or (same_layout and torch.equal(new, kept))


# model -> {batch size: `Writes`}: the latest graphed call's writes per batch size, for the next calls.

def suffix_stops(suffix: tuple, window: int, seq: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """`[B, L]` bool on the device: whether one of the stop-string criteria `suffix` (windows of `window` tokens)
    ends row b's sequence `seq[b, :ends[b, j]]` (`ends`: `[B, L]`, at least `window`). Ends past the sequence give
    meaningless entries."""
    B, L = ends.shape
    # A round's host time is mostly launches like these: one add for the
    # columns, one criterion call per criterion (a single one holds every stop string of a request).
    offsets = cached_arange(window, seq.device, -window)  # [W]
    columns = (ends[..., None] + offsets).clamp_(max=seq.shape[1] - 1)  # [B, L, W], ends >= window
    windows = seq.gather(1, columns.view(B, -1)).view(B * L, window)
    stops = functools.reduce(torch.logical_or, (criterion(windows, None) for criterion in suffix))
    return stops.view(B, L)


@functools.lru_cache(maxsize=64)  # keyed by prompt lengths too: bounded
def cached_arange(n: int, device: torch.device, start: int = 0) -> torch.Tensor:
    """`[n]`: `start, ..., start + n - 1` on `device`, made once per call's arguments (read-only: index arithmetic
    of every round, one launch fewer each)."""
    return torch.arange(start, start + n, device=device)
