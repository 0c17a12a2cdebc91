"""eval/render_benchmarks.py: BENCHMARKS.md's tables rendered from the JSONL, sections without data left alone."""

from __future__ import annotations

import json

from eval import render_benchmarks as render

MACHINE = {"gpu": "NVIDIA H200", "torch": "2.11", "triton": "3.6", "transformers": "5.17", "fla": None,
           "commit": "0000000", "dirty": False}  # fmt: skip
SETTINGS = {"model": "eval/house/checkpoint", "dtype": "bfloat16", "max_new_tokens": 128, "drafter": "mtp",
            "depth": [10], "chain_depth": [10], "topk": 4, "budget": ["auto"], "epsilon": [0.3], "repeats": 3,
            "interleave": True, "cuda_graphs": True}  # fmt: skip


def _row(mode, batch, tps, **extra):
    return {"machine": MACHINE, "settings": SETTINGS, "dataset": "mbpp", "mode": mode, "batch_size": batch,
            "num_prompts": 8, "output_tokens_per_s": tps, "mean_accepted_tokens": extra.pop("acc", None),
            "exact_share": extra.pop("exact", None), "error": None, **extra}  # fmt: skip


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_render(tmp_path, monkeypatch):
    data, doc = tmp_path / "benchmarks", tmp_path / "BENCHMARKS.md"
    data.mkdir()
    monkeypatch.setattr(render, "DATA", data)
    monkeypatch.setattr(render, "DOC", doc)
    readme = tmp_path / "README.md"
    readme.write_text("# results\n<!-- rendered: readme_results -->\n<!-- end: readme_results -->\n")
    monkeypatch.setattr(render, "README", readme)
    sections = [*render.E2E, "layouts", "kernels", "kda", *render.BUDGETS, "tables"]
    doc.write_text("".join(f"# {n}\n<!-- rendered: {n} -->\nold {n}\n<!-- end: {n} -->\n" for n in sections))
    _write(data / "e2e_house_b1.jsonl", [
        _row("ar", 1, 100.0), _row("ar-static", 1, 500.0, exact=0.75), _row("chain", 1, 2000.0, acc=6.5, exact=1.0),
        _row("tree-serial", 1, None, error="out of memory"),
        _row("bole", 1, 2500.0, acc=8.0, exact=1.0, budget_source="table x.json at epsilon 0.3"),
    ])  # fmt: skip
    kernel_rows = [{"header": {**MACHINE, "commit": None}}] + [
        {"op": "verify", "provider": p, "H": 32, "B": 1, "T": 16, "HK": 16, "K": 128, "V": 128, "depth": 8,
         "precision": "tf32x3", "ms": ms, "transient_bytes": 3 * 2**20} for p, ms in (("serial", 0.04), ("bole", 0.01))
    ]  # fmt: skip
    _write(data / "kernels.jsonl", kernel_rows)
    kda_header = {"device": "NVIDIA H200", "torch": "2.11", "triton": "3.6", "transformers": "5.17", "fla": "0.6.0",
                  "commit": None}  # fmt: skip
    _write(data / "kda.jsonl", [
        {"header": kda_header, "errors": {"fp32_o": 2e-6, "fla_o": 0.5}, "H": 32, "K": 128, "V": 128,
         "precision": "tf32x3"},
        *({"provider": p, "B": 1, "T": 64, "depth": 8, "ms": ms, "transient_bytes": 2**20 if p == "bole" else None}
          for p, ms in (("bole", 0.02), ("commit", 0.01), ("fla-chunk", 0.025), ("serial", 0.1))),
    ])  # fmt: skip
    budget_settings = {**SETTINGS, "depth": [5]}
    _write(data / "budget_house.jsonl", [
        {**_row(f"bole b{b}", 8, t), "settings": budget_settings, "tree_budget": b, "tree_epsilon": 0.3,
         "tree_depth": 5} for b, t in ((32, 900.0), (128, 1000.0), ("auto", 990.0))
    ])  # fmt: skip
    tp = {**SETTINGS, "shape": "122B-A10B", "tensor_parallel": 2, "device_map": None}
    _write(data / "e2e_122b_tp_b1.jsonl", [
        {**_row("ar", 1, 10.0), "settings": tp}, {**_row("bole", 1, 35.0, acc=4.0, exact=1.0), "settings": tp}
    ])  # fmt: skip
    render.main()
    text = doc.read_text()
    assert "| 122B-A10B | tensor parallel over 2 GPUs | 1 | 10.0 | 35.0 | 3.50× | 4.00 | 100% |" in text
    # e2e: every mode's tokens/s, a failed mode's error, bole against each baseline, where the budget came from
    assert "| mbpp | 1 | 100.0 | 500.0 | 2000.0 | out of memory | 2500.0 | 5.000× | 1.250× | – | 6.50 / – / 8.00 |" in text
    assert "75% / 100% / – / 100%" in text and "bole: table x.json" in text
    assert "commit `0000000`, a commit this clone's history lacks: not known to be the current code" in text
    assert "| 32 | 1 | 16 | 0.040 | – | 0.010 | 4.0× | – | 32 | 3.0 |" in text and "commit unknown" in text
    assert "| 8 | 900.0 | **1000.0** | 990.0 | 0.99 |" in text and "the house model, mbpp" in text
    assert "| 1 | 64 | 8 | 0.100 | 0.025 | 0.020 | 0.010 | 0.80× | 5.00× | 1.0 | – |" in text
    assert "largest error 2.0e-06" in text  # fla's own distance from float64 is not ours
    assert "old e2e_9b_b1" in text and "old budget_9b" in text  # no data: left as it was
    assert "| house model | NVIDIA H200 | bfloat16 | closed_form |" in text  # the shipped tables
    assert (data / "speedup.png").stat().st_size > 0
    assert "| house | mbpp | 1 | 100.0 | 500.0 | 2000.0 | out of memory | 2500.0 | 5.00× | 1.25× |" in readme.read_text()
