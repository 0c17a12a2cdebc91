"""A stand-in for CUDA graph capture on any device, to test the bookkeeping around `hf_bole.generation.graphs.capture`
(static input buffers, one graph per key, outputs read from the graph's buffers) without a GPU."""

from __future__ import annotations

import dataclasses


class RecordedGraph:
    """`replay` runs the captured call again and writes its results into the tensors the capture returned (the
    fields of a dataclass), which is what replaying a CUDA graph does."""

    def __init__(self, run, out):
        self.run, self.out = run, out

    def replay(self):
        new = self.run()
        for field in dataclasses.fields(self.out):
            getattr(self.out, field.name).copy_(getattr(new, field.name))

    def pool(self):
        return None


def recording_capture(captured: list):
    """A replacement for `capture(run, device, pool)` that appends each capture's outputs to `captured`."""

    def capture(run, device, pool=None):
        out = run()
        captured.append(out)
        return RecordedGraph(run, out), out

    return capture
