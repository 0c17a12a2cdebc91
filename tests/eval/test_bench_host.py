"""eval/bench_host.py on CPU (the torch path): one JSON line per shape after the header, every time measured."""

from __future__ import annotations

import json

from eval import bench_host


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
