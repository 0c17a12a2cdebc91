"""Host-side bookkeeping of a call's rows: tokens read back, where each row finished, which rows still decode, and
the rounds queued on the device that the host has not read yet."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_bole.generation.stopping import Stopping
from hf_bole.generation.tree import DraftTree
from hf_bole.generation.writes import Done, Writes, Written


@dataclass
class Queued:
    """A round (or the prefill's first token) queued on the GPU: its tokens on their way to the host (`Rows.write`),
    and with a pipelined custom drafter a host copy of the tree it proposed, checked when the round is read."""

    tokens: Written
    tree: DraftTree | None
    round: bool = True  # False for the first token, which the prefill gives


def read_round(state: Rows, queued: Queued, draft) -> list[int]:
    """Reads a queued round on the host (waiting for it): checks its tree (`draft.CheckedDraft.check`), then emits its
    tokens; returns how many tokens each row accepted (0 for a row that sat it out)."""
    if queued.tree is not None:
        queued.tokens.ready.synchronize()  # the tree's copy was queued before the round's tokens
        draft.check(queued.tree)
    return state.read(queued.tokens)


class Rows:
    """Host-side bookkeeping of every row: tokens generated, where it finished, whether it still decodes."""

    def __init__(self, B: int, P: int, max_new: int, stopping: Stopping, writes: Writes):
        self.B, self.P, self.max_new, self.stopping, self.pad = B, P, max_new, stopping, writes.pad
        self.writes, self.generated = writes, writes.generated
        self.n_gen = [0] * B
        # What the writes' sequences may hold, on the host: each row's tokens written as far as read, and the widths
        # of the writes not read yet (`Writes.reserve` keeps room for them).
        self.written = [0] * B
        self.unread = 0
        self.tokens: list[list[int]] = [[] for _ in range(B)]
        self.finished_at: list[int | None] = [None] * B  # generated length when a stopping criterion fired
        self.frozen = [False] * B  # finished and padded from then on, as plain decoding does with an EOS criterion

    @property
    def seq(self) -> torch.Tensor:
        """`[B, width]` every row's sequence on the device (`Writes.seq`: a wider copy after it grew)."""
        return self.writes.seq

    def limit(self) -> int:
        """How many tokens rows need: `max_new`, or, once every row has finished, the last one to finish
        (plain decoding stops there; rows that are not padded keep producing real tokens until then)."""
        if all(f is not None for f in self.finished_at):
            return max(self.finished_at)
        return self.max_new

    def active(self) -> list[bool]:
        limit = self.limit()
        return [not self.frozen[b] and self.n_gen[b] < limit for b in range(self.B)]

    def write(self, tokens: torch.Tensor, lengths: torch.Tensor) -> Written:
        """Appends `tokens[b, :lengths[b]]` (`[B, L]` and `[B]` on the device) to every row of `seq` on the device
        and starts copying them, with what the stop strings say of them, to the host; `read` takes them from
        there. Reads nothing on the host."""
        self.unread += tokens.shape[1]
        self.writes.reserve(self.P + max(self.written) + self.unread)
        host = self.writes.append(tokens, lengths).to("cpu", non_blocking=True)  # pinned memory, from a CUDA device
        ready = torch.cuda.Event() if tokens.is_cuda else Done()
        ready.record()
        return Written(host, ready, tokens.shape[1], bool(self.stopping.suffix))

    def read(self, written: Written) -> list[int]:
        """Emits a round `write` started, token by token through the stopping rules, once its copy has arrived
        (the loop's one wait for the GPU); returns how many tokens each row accepted (0 for rows already done)."""
        written.ready.synchronize()
        host, L = written.host.tolist(), written.width
        self.unread -= L
        counted = []
        for b, row in enumerate(host):
            self.written[b] += row[0]
            limit = self.limit()
            if self.frozen[b] or self.n_gen[b] >= limit:
                counted.append(0)
                continue
            counted.append(row[0])
            tokens = row[1 : 1 + min(row[0], limit - self.n_gen[b])]  # a row takes no tokens past the limit
            if self.finished_at[b] is None:
                suffix = row[1 + L : 1 + L + len(tokens)] if written.suffix else None
                stop = self.stopping.first_stop(
                    tokens, self.P + self.n_gen[b], suffix, lambda n, b=b: self.seq[b : b + 1, :n]
                )
                if stop is not None:
                    self.finished_at[b] = self.n_gen[b] + stop + 1
                    self.frozen[b] = self.stopping.pads_finished
                    # Padded from there on; or, once every row has finished, the limit falls to the last to finish.
                    kept = stop + 1 if self.frozen[b] else self.limit() - self.n_gen[b]
                    tokens = tokens[:kept]
            self.tokens[b].extend(tokens)
            self.n_gen[b] += len(tokens)
        return counted

    def output_length(self) -> int:
        return min(self.limit(), max(self.n_gen))

    def sequences(self, T_out: int) -> torch.LongTensor:
        """`[B, P + T_out]`: the prompt, each row's tokens, and padding after a row that finished with EOS."""
        out = self.seq[:, : self.P + T_out].clone()
        for b in range(self.B):
            if self.n_gen[b] < T_out:
                out[b, self.P + self.n_gen[b] :] = self.pad
        return out


def upload_flags(flags: list[bool], device: torch.device) -> torch.Tensor:
    """`[B]` bool on `device`, without waiting for the GPU: a copy from pageable memory would wait for every launch
    queued before it (a whole round in flight, each time a row finishes). The pinned block is not reused before its
    copy has run (torch's caching host allocator records the copy)."""
    host = torch.tensor(flags, device="cpu")  # not the default device, which may be CUDA
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
