"""Where a decoding round's time goes (`bole_profile=True`): draft, select, verify, accept, commit, host."""

from __future__ import annotations

import time

import torch

PHASES = ("draft", "select", "verify", "accept", "commit", "host")


class PhaseTimer:
    """Marks the end of every phase of every round without synchronising inside the round: on CUDA a timing event
    on the current stream (all read once, by `totals_ms`), elsewhere the host clock. On CUDA a phase is therefore
    device-timeline time, idle gaps included: "host" is the time the GPU waits for the host's bookkeeping. Each
    phase is also a `bole::<phase>` range for torch's profiler (`eval/profile_round.py` reads the host time and the
    kernels of each). Beside it, `host_totals_ms` is the host clock's time in each phase's code: where a phase's host
    time exceeds its device time, the GPU waits for Python once the host falls behind. A disabled timer does nothing.

    Example:

    ```python
    >>> timer = PhaseTimer(torch.device("cpu"), enabled=True)
    >>> timer.round_start()
    >>> timer.mark("draft")
    >>> sorted(timer.totals_ms())
    ['accept', 'commit', 'draft', 'host', 'rounds', 'select', 'verify']
    >>> sorted(timer.host_totals_ms()) == sorted(timer.totals_ms())
    True
    ```
    """

    def __init__(self, device: torch.device, enabled: bool):
        self.enabled, self.cuda = enabled, device.type == "cuda"
        # (phase that ends here, or None at a round's start; device-timeline time; host clock)
        self.marks: list[tuple[str | None, object, float]] = []
        self.rounds = 0
        self._range: torch.profiler.record_function | None = None  # the profiler range of the phase under way

    def round_start(self) -> None:
        if self.enabled:
            self.rounds += 1
            self.marks.append((None, *self._now()))
            self._enter(PHASES[0])

    def mark(self, phase: str) -> None:
        if self.enabled:
            self.marks.append((phase, *self._now()))
            self._range.__exit__(None, None, None)
            self._range = None
            following = PHASES.index(phase) + 1
            if following < len(PHASES):
                self._enter(PHASES[following])

    def _enter(self, phase: str) -> None:
        self._range = torch.profiler.record_function(f"bole::{phase}")
        self._range.__enter__()

    def _now(self) -> tuple[object, float]:
        """(device-timeline time, host clock): a CUDA event, or without CUDA the host clock itself."""
        host = time.perf_counter()
        if not self.cuda:
            return host, host
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event, host

    def totals_ms(self) -> dict[str, float] | None:
        """Milliseconds per phase summed over the rounds, plus `rounds`; None when disabled."""
        if not self.enabled:
            return None
        if self.cuda and self.marks:
            self.marks[-1][1].synchronize()
        elapsed = (lambda a, b: a.elapsed_time(b)) if self.cuda else (lambda a, b: 1e3 * (b - a))
        return self._totals(1, elapsed)

    def host_totals_ms(self) -> dict[str, float] | None:
        """Milliseconds of the host clock in each phase's code summed over the rounds, plus `rounds`; None when
        disabled. Without CUDA the same as `totals_ms`."""
        if not self.enabled:
            return None
        return self._totals(2, lambda a, b: 1e3 * (b - a))

    def _totals(self, clock: int, elapsed) -> dict[str, float]:
        totals = dict.fromkeys(PHASES, 0.0)
        for start, end in zip(self.marks, self.marks[1:]):
            if end[0] is not None:  # the gap from one round's end to the next round's start is not a phase
                totals[end[0]] += elapsed(start[clock], end[clock])
        return {**totals, "rounds": self.rounds}
