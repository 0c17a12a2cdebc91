"""Token streams cut into training and validation windows.

Documents are packed GPT-2 style: one stream of `tokens + <|endoftext|>` per document, attention running across
document boundaries. A window is `seq_len + 1` consecutive tokens: the model reads the first `seq_len` and the last
`seq_len` are its next-token labels (the MTP steps read their tokens and labels from the same window).
"""

from __future__ import annotations

import numpy as np
import torch


class TrainWindows:
    """Uniformly random windows of one token stream, drawn on the stream's device (no host round trip per step).

    Sources are mixed by `repeats`: a source repeated r times is drawn r times as often per token. The stream is the
    concatenation of every source's stream, each repeated `repeats[source]` times (whole repeats only)."""

    def __init__(
        self,
        streams: dict[str, np.ndarray],
        repeats: dict[str, int],
        seq_len: int,
        device: torch.device,
        seed: int = 0,
    ):
        parts = [streams[source] for source in streams for _ in range(repeats.get(source, 1))]
        tokens = np.concatenate(parts).astype(np.int32)
        if len(tokens) <= seq_len + 1:
            raise ValueError(f"the training stream has {len(tokens)} tokens, fewer than one window of {seq_len + 1}")
        self.tokens = torch.from_numpy(tokens).to(device)  # [N]
        self.seq_len = seq_len
        self.offsets = torch.arange(seq_len + 1, device=device)  # [T+1]
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __len__(self) -> int:
        return self.tokens.numel()

    def sample(self, batch_size: int) -> torch.Tensor:
        """`[batch_size, seq_len + 1]` int64."""
        high = self.tokens.numel() - self.seq_len - 1
        starts = torch.randint(0, high + 1, (batch_size,), device=self.tokens.device, generator=self.generator)
        return self.tokens[starts[:, None] + self.offsets].long()


def valid_windows(stream: np.ndarray, seq_len: int, max_windows: int) -> torch.Tensor:
    """The first `max_windows` non-overlapping windows `[n, seq_len + 1]` (int64, CPU) of a held-out stream."""
    n = min(max_windows, (len(stream) - 1) // seq_len)
    if n < 1:
        raise ValueError(f"a held-out stream of {len(stream)} tokens holds no window of {seq_len + 1}")
    index = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)
    return torch.from_numpy(stream[index].astype(np.int64))
