"""Every row's sequence on the device, as plain decoding's `input_ids` holds it, and the writes of each round's tokens
into it (replayed from CUDA graphs with `bole_cuda_graphs`), with their copy to the host."""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch

from hf_bole.generation.graphs import KEPT_CAPACITY_STEP, ShapeGraphs
from hf_bole.generation.stopping import Stopping, StopTables, cached_arange, suffix_stops


class Writes:
    """The device side of `Rows.write`: every row's sequence as plain decoding's `input_ids` holds it (`seq`, `[B,
    width]`: left padding, prompt, generated tokens, and a spare last column that takes the writes of padding
    entries), the rows' counts (`generated`, `[B]`, advanced in place) and the writes of each round's tokens
    (`_append`), replayed with `graphed` from a CUDA graph per width.

    With graphs, `for_call` keeps one for the model's next calls of the same batch size, padding id and stop-string
    criteria (`_same_criteria`): its graphs are captured once, where a call's own took an eager write and a capture
    of about 35 launches each (with stop strings) in every call. The prompt's width is an input on the device
    (`start`), so that calls of other lengths replay the same graphs.
    """

    def __init__(self, B: int, width: int, pad: int, stopping: Stopping, device: torch.device, graphed: bool):
        self.pad = pad
        self.suffix, self.window = tuple(stopping.suffix), stopping.window if stopping.suffix else 0
        self.tables = tuple(StopTables.of(c) for c in self.suffix)  # taken before the criteria's first call
        self.seq = torch.full((B, width), pad, dtype=torch.long, device=device)
        # Tokens written per row. It runs ahead of `Rows.n_gen` by the rounds the host has not read, and past it in a
        # row that stopped inside a round's path (the row is done then).
        self.generated = torch.zeros(B, dtype=torch.long, device=device)
        self.start = torch.zeros((), dtype=torch.long, device=device)  # the call's prompt width P
        self.graphed = graphed
        self._bind()

    def _bind(self) -> None:
        """`append`: `_append` on `seq` (replayed from graphs with `graphed`, which hold its address)."""
        append = functools.partial(_append, self.seq, self.generated, self.start, self.suffix, self.window, self.pad)
        self.append = ShapeGraphs(append) if self.graphed else append

    def reserve(self, width: int) -> None:
        """Makes `seq` hold `width` columns before its spare one: a copy into one twice as wide (in steps of
        `KEPT_CAPACITY_STEP` with graphs, captured again), so that a call's sequences grow with its tokens, not with
        `max_new_tokens`. Queued on the device after the writes before it."""
        if width < self.seq.shape[1]:
            return
        B, old = self.seq.shape
        new = max(width + 1, 2 * old)
        new = -(-new // KEPT_CAPACITY_STEP) * KEPT_CAPACITY_STEP if self.graphed else new
        seq = torch.full((B, new), self.pad, dtype=torch.long, device=self.seq.device)
        seq[:, :old] = self.seq
        self.seq = seq
        self._bind()

    @classmethod
    def for_call(
        cls, model, input_ids: torch.Tensor, width: int, pad: int, stopping: Stopping, graphed: bool
    ) -> Writes:
        """Writes for a call of prompts `input_ids` (`[B, P]`) whose sequences need `width` columns: the model's
        kept ones where they fit (with `graphed`), else new ones; set to the prompts, nothing generated."""
        B, P = input_ids.shape
        writes = _WRITES.get(model, {}).get(B) if graphed else None
        if writes is None or not writes._serves(width, pad, stopping, input_ids.device):
            # Kept widths go up in steps, as the caches' capacities do, so that calls of similar lengths share one.
            width = -(-width // KEPT_CAPACITY_STEP) * KEPT_CAPACITY_STEP if graphed else width
            writes = cls(B, width, pad, stopping, input_ids.device, graphed)
            if graphed:
                _WRITES.setdefault(model, {})[B] = writes
        else:
            writes.seq[:, P:] = pad
            writes.generated.zero_()
        writes.seq[:, :P] = input_ids
        writes.start.fill_(P)
        return writes

    def _serves(self, width: int, pad: int, stopping: Stopping, device: torch.device) -> bool:
        window = stopping.window if stopping.suffix else 0
        return (self.seq.shape[1] >= width and self.pad == pad and self._same_criteria(stopping.suffix)
                and self.window == window and self.seq.device == device)  # fmt: skip

    def _same_criteria(self, suffix: list) -> bool:
        """Whether the stop-string criteria `suffix` answer as the kept ones do: a graph replays the kernels of
        those it captured, on their tensors, and never calls `suffix`'s. The same objects, or `StopStringCriteria` of
        equal tables: `generate(stop_strings=...)` builds new criteria every call."""
        return len(self.suffix) == len(suffix) and all(
            kept is new or tables.match(new) for kept, tables, new in zip(self.suffix, self.tables, suffix)
        )

_WRITES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def drop_writes(model) -> None:
    """Forgets the writes kept for `model`'s graphed calls (`hf_bole.release`)."""
    _WRITES.pop(model, None)


def _append(
    seq: torch.Tensor, generated: torch.Tensor, start: torch.Tensor, suffix: tuple, window: int, pad: int,
    tokens: torch.Tensor, lengths: torch.Tensor,
) -> torch.Tensor:
    """`Rows.write`'s device work: writes `tokens[b, :lengths[b]]` (`[B, L]`, `[B]`) into `seq` after the row's
    `generated` tokens, which follow `start` (`[]`) columns of prompt, and advances `generated` in place; returns
    `[B, 1 + L (+ L)]`: the lengths, the tokens and, with stop strings, whether each token ends one. No host reads (a
    CUDA graph replays it)."""
    L = tokens.shape[1]
    steps = cached_arange(L, tokens.device)  # [L]
    # Write first: stopping criteria read the row's ids. Entries past a row's length go to the spare last column as
    # padding: a finished row's count may run past the sequence by the rounds in flight, and the stop strings'
    # windows over its entries then read that column (their criterion embeds every id: no -1 there). Entries past a
    # stop are overwritten or padded later.
    real = steps < lengths[:, None]  # [B, L]
    columns = (generated + start)[:, None] + steps  # [B, L] where each token goes
    seq.scatter_(1, torch.where(real, columns, seq.shape[1] - 1), torch.where(real, tokens, pad))
    stops = suffix_stops(suffix, window, seq, columns + 1) if suffix else None  # [B, L]
    generated.add_(lengths)
    return torch.cat([lengths[:, None], tokens] + ([stops.long()] if stops is not None else []), dim=1)

@dataclass
class Written:
    host: torch.Tensor  # [B, 1 + L (+ L)] on the host: lengths, tokens (and stop-string hits), arriving
    ready: object  # an event recorded after the copy
    width: int  # L
    suffix: bool  # whether stop-string hits follow the tokens


class Done:
    """The event of a copy that has completed (off CUDA, copies are synchronous)."""

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass
