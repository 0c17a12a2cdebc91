"""eval/bench_host.py on CPU (the torch path, and the Triton kernels under the interpreter): one JSON line per shape
after the header, every time the path has measured."""

from __future__ import annotations

import json

import pytest
import torch

from eval import bench_host
from hf_bole.kernels import tree_ancestor_mask, tree_gdn_verify
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
        keys = ("verify_us", "verify_triton_us", "checks_us", "ancestors_us", "ancestors_triton_us")
        assert all(r[key] > 0 for key in keys)
        assert r["launches_us"] is None and r["allocations_us"] is None  # the torch path launches and allocates none


@pytest.mark.interpreter
def test_launches_are_timed_alone():
    """Through the Triton kernels (the interpreter here), the verify's two launches and four allocations are recorded
    and replayed, and the verify launches through its own `CachedLaunch`es and allocates with torch's own
    `torch.empty` again afterwards."""
    empty = torch.empty
    row = bench_host.bench_shape(1, 8, HK=1, H=2, K=16, V=16, device="cpu", calls=1, passes=1)
    assert row["launches_us"] > 0 and row["allocations_us"] > 0
    assert all(type(launch) is CachedLaunch for launch in (closed_form_kernels._SOLVE, closed_form_kernels._APPLY))
    assert torch.empty is empty
    B, T, HK, H, K, V = 1, 8, 1, 2, 16, 16
    q, k, v = torch.randn(B, T, HK, K), torch.randn(B, T, HK, K), torch.randn(B, T, H, V)
    g, beta, h0 = -torch.rand(B, T, H), torch.rand(B, T, H), torch.randn(B, H, K, V)
    parents = torch.arange(-1, T - 1)[None]
    anc = tree_ancestor_mask(parents)
    launches, allocations = bench_host.recorded_call(
        lambda: tree_gdn_verify(q, k, v, g, beta, parents, h0, ancestors=anc)
    )
    assert [launch for launch, _ in launches] == [closed_form_kernels._SOLVE, closed_form_kernels._APPLY]
    assert len(allocations) == 4  # o, u, log P and the workspace (the norms after its blocks)
