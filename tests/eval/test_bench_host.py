"""eval/bench_host.py on CPU (the torch path, and the Triton kernels under the interpreter): one JSON line per shape
after the header, every time measured."""

from __future__ import annotations

import json

import pytest

from eval import bench_host
from hf_bole.kernels.launch import CachedLaunch
from hf_bole.kernels.tree_gdn import closed_form_kernels


def test_bench_host_cpu(tmp_path):
    out = tmp_path / "host.jsonl"
    args = ["--device", "cpu", "--out", str(out), "--shapes", "1,4", "2,3", "--calls", "2", "--passes", "2"]
    rows = bench_host.main(args)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines[0]["header"]["gpu"] and lines[1:] == rows
    assert [(r["B"], r["T"]) for r in rows] == [(1, 4), (2, 3)]
    for r in rows:
        keys = ("verify_us", "verify_triton_us", "checks_us", "allocations_us", "ancestors_us", "ancestors_triton_us")
        assert all(r[key] > 0 for key in keys)
        assert r["launches_us"] is None  # the torch path launches no kernel


@pytest.mark.interpreter
def test_launches_are_timed_alone():
    """Through the Triton kernels (the interpreter here), the verify's two launches are recorded and relaunched, and
    the verify launches through its own `CachedLaunch`es again afterwards."""
    row = bench_host.bench_shape(1, 8, HK=1, H=2, K=16, V=16, device="cpu", calls=1, passes=1)
    assert row["launches_us"] > 0 and row["allocations_us"] > 0
    assert all(type(launch) is CachedLaunch for launch in (closed_form_kernels._SOLVE, closed_form_kernels._APPLY))
