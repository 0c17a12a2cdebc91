"""Tokens handed to a `generate` streamer as plain decoding hands them: one step at a time, every row's token."""

from __future__ import annotations

import torch

from hf_bole.generation.rows import Rows


class Streamer:
    """Hands tokens to a streamer exactly as plain decoding does: one `[B]` host tensor per step, a step once every
    row has produced its token there (a padded row contributes its pad)."""

    def __init__(self, streamer, rows: Rows):
        self.streamer, self.rows = streamer, rows
        self.sent = 0

    def flush(self, upto: int | None = None, final: bool = False) -> None:
        rows = self.rows
        if upto is None:
            upto = min(rows.max_new if rows.frozen[b] else rows.n_gen[b] for b in range(rows.B))
            upto = min(upto, rows.limit())
        if self.streamer is not None:
            for t in range(self.sent, upto):
                step = [rows.tokens[b][t] if t < rows.n_gen[b] else rows.pad for b in range(rows.B)]
                self.streamer.put(torch.tensor(step, device="cpu"))  # on the host, as plain decoding's `.cpu()`
        self.sent = max(self.sent, upto)
        if final and self.streamer is not None:
            self.streamer.end()
