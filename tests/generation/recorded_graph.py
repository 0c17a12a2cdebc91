"""A stand-in for CUDA graph capture on any device, to test the bookkeeping around `hf_bole.generation.graphs.capture`
(static input buffers, one graph per key, outputs read from the graph's buffers) without a GPU."""

from __future__ import annotations

import dataclasses

import torch


class RecordedGraph:
    """`replay` runs the captured call again and writes its results into the tensors the capture returned (the
    fields of a dataclass), which is what replaying a CUDA graph does."""

    def __init__(self, run, out, ran: bool = False):
        self.run, self.out = run, out
        self.ran = ran  # the capture's own call did the first replay's work (a capture without warm-up)

    def replay(self):
        if self.ran:
            self.ran = False
            return
        new = self.run()
        if self.out is None:  # the call's work is all in what it writes
            return
        if isinstance(self.out, torch.Tensor):
            self.out.copy_(new)
            return
        for field in dataclasses.fields(self.out):
            if isinstance(value := getattr(self.out, field.name), torch.Tensor):
                value.copy_(getattr(new, field.name))

    def pool(self):
        return None


def recording_capture(captured: list):
    """A replacement for `capture(run, device, pool, warm_up)` that appends each capture's outputs to `captured`.

    The call that records is a real call, so without `warm_up` (work that must not run twice: the round's tail) it
    stands for the first replay, which then does nothing. Later replays run the host's side of the call too, which
    a CUDA graph's do not."""

    def capture(run, device, pool=None, warm_up=True):
        out = run()
        captured.append(out)
        return RecordedGraph(run, out, ran=not warm_up), out

    return capture


def recording_queued_capture(captured: list):
    """The same for `capture_queued(run, device)`, which never warms up: the recording call is the first replay."""

    def capture_queued(run, device):
        out = run()
        captured.append(out)
        return RecordedGraph(run, out, ran=True), out

    return capture_queued
