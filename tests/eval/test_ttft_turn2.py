"""eval/ttft_turn2.py: a second turn's time to first token, continued against prefilled again, on a CPU smoke shape."""

from __future__ import annotations

import json

from eval import ttft_turn2


def test_tiny_run_writes_one_line_with_every_arm(tmp_path):
    out = tmp_path / "ttft.jsonl"
    line = ttft_turn2.main(["--tiny", "--device", "cpu", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(line))
    assert set(line["seconds"]) == set(ttft_turn2.ARMS) and all(len(v) == 2 for v in line["seconds"].values())
    assert all(line["same_tokens_as_bole_prefill"].values())  # fp32: every arm the same tokens
    assert line["speedup_continued_over_prefill"] > 0


def test_profile_writes_a_trace(tmp_path, capsys):
    trace = tmp_path / "trace.json"
    ttft_turn2.main(["--tiny", "--device", "cpu", "--profile", str(trace)])
    assert json.loads(trace.read_text())["traceEvents"]
    assert "profiled call: first token after" in capsys.readouterr().out
