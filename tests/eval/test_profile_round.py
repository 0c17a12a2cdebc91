"""eval/profile_round.py: where a round's time goes, per phase, on the host and on the GPU timeline."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eval import profile_round
from tests.eval.test_run import checkpoint  # noqa: F401  (the module-scoped fixture)

CUDA, CPU = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU


@dataclass
class _Range:
    start: float
    end: float

    def elapsed_us(self) -> float:
        return self.end - self.start


@dataclass
class _Event:
    name: str
    device_type: torch.autograd.DeviceType
    time_range: _Range


class _Profile:
    def __init__(self, events):
        self._events = events

    def events(self):
        return self._events


def test_kernels_fall_in_the_phase_range_around_them():
    """A kernel belongs to the GPU-timeline range it starts in ("-" between ranges); host-side ranges and the
    ranges themselves are no kernels."""
    prof = _Profile([
        _Event("bole::draft", CUDA, _Range(10, 50)),
        _Event("bole::verify", CUDA, _Range(60, 100)),
        _Event("bole::draft", CPU, _Range(0, 45)),  # the host's range: not on the GPU timeline
        _Event("k_before", CUDA, _Range(0, 5)),
        _Event("k_draft_a", CUDA, _Range(10, 14)),
        _Event("k_draft_b", CUDA, _Range(40, 49)),
        _Event("k_gap", CUDA, _Range(52, 55)),
        _Event("k_verify", CUDA, _Range(61, 90)),
        _Event("host_op", CPU, _Range(20, 30)),
    ])  # fmt: skip
    kernels = profile_round._kernels_by_phase(prof, profile_round._gpu_phase_ranges(prof))
    got = [(name, phase, duration) for _, duration, phase, name in kernels]
    assert got == [("k_before", "-", 5), ("k_draft_a", "draft", 4), ("k_draft_b", "draft", 9), ("k_gap", "-", 3),
                   ("k_verify", "verify", 29)]  # fmt: skip
    assert profile_round._gpu_phase_ranges(prof) == [(10, 50, "draft"), (60, 100, "verify")]


@dataclass
class _Average:
    key: str
    device_type: torch.autograd.DeviceType
    cpu_time_total: float


def test_host_time_comes_from_the_host_side_ranges():
    """With a GPU every phase's range is averaged twice, on the host and on the GPU timeline (no host time there),
    in either order."""
    events = [
        _Average("bole::draft", CPU, 80.0),
        _Average("bole::draft", CUDA, 0.0),
        _Average("bole::verify", CUDA, 0.0),
        _Average("bole::verify", CPU, 30.0),
        _Average("aten::mm", CPU, 5.0),
    ]
    assert profile_round._host_phase_us(events) == {"draft": 80.0, "verify": 30.0}


def test_phases_report_the_host_time_of_their_code(checkpoint, tmp_path):  # noqa: F811
    """On the CPU the table still runs: every phase's host time is measured (the host-side ranges, not the GPU
    timeline's, which share their names), with no GPU kernels."""
    rows = profile_round.main([
        "--model", str(checkpoint), "--datasets", "mbpp", "--num-prompts", "1", "--max-new-tokens", "6",
        "--batch-sizes", "1", "--modes", "bole", "--device", "cpu", "--json", str(tmp_path / "p.json"),
    ])  # fmt: skip
    (bole,) = [r for r in rows if r["mode"] == "bole"]
    phases = bole["phases"]
    assert phases["draft"]["host_ms"] > 0 and phases["verify"]["host_ms"] > 0
    assert all(p["kernel_ms"] == 0 and p["span_ms"] == 0 for p in phases.values())
