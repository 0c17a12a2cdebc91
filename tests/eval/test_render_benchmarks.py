"""eval/render_benchmarks.py: BENCHMARKS.md's tables rendered from the JSONL, sections without data left alone."""

from __future__ import annotations

import json
import subprocess

from eval import render_benchmarks as render

MACHINE = {"gpu": "NVIDIA H200", "torch": "2.11", "triton": "3.6", "transformers": "5.17", "fla": None,
           "commit": "0000000", "dirty": False}  # fmt: skip
SETTINGS = {"model": "eval/house/checkpoint", "dtype": "bfloat16", "max_new_tokens": 128, "drafter": "mtp",
            "depth": [10], "chain_depth": [10], "topk": 4, "budget": ["auto"], "epsilon": [0.3], "repeats": 3,
            "interleave": True, "cuda_graphs": True}  # fmt: skip
# eval/ttft_turn2.py's line: per arm the median and each pass's seconds, and whether its tokens were re-prefilling's
TTFT_PER_ARM = ("median_s", "seconds", "same_tokens_as_bole_prefill")
_ARMS = ("bole-continued", "bole-kept", "bole-prefill", "plain-continued", "plain-prefill")
TTFT = {
    "machine": MACHINE, "shape": "9B", "dtype": "bfloat16", "history": 2000, "turn": 32, "new": 16, "passes": 5,
    "median_s": dict(zip(_ARMS, (0.01, 0.008, 0.08, 0.05, 0.075))),
    "seconds": dict(zip(_ARMS, ([0.009, 0.01], [0.007, 0.009], [0.072, 0.08], [0.05, 0.06], [0.075, 0.08]))),
    "same_tokens_as_bole_prefill": dict(zip(_ARMS, (True, True, True, False, True))),
}  # fmt: skip


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
    sections = [*render.E2E, *render.KDA_E2E, "layouts", "kernels", "host", "kda", *render.BUDGETS, "batch_sweep"]
    sections += ["ttft_turn2", "tables"]
    doc.write_text("".join(f"# {n}\n<!-- rendered: {n} -->\nold {n}\n<!-- end: {n} -->\n" for n in sections))
    _write(data / "e2e_house_b1.jsonl", [
        _row("ar", 1, 100.0), _row("ar-static", 1, 500.0, exact=0.75), _row("chain", 1, 2000.0, acc=6.5, exact=1.0),
        _row("tree-serial", 1, None, error="out of memory"),
        _row("bole", 1, 2500.0, acc=8.0, exact=1.0, budget_source="table x.json at epsilon 0.3"),
    ])  # fmt: skip
    kernel_rows = [{"header": {**MACHINE, "commit": None}}] + [
        {"op": "verify", "provider": p, "H": 32, "B": 1, "T": 16, "HK": 16, "K": 128, "V": 128, "depth": 8,
         "precision": "tf32x3", "ms": ms, "transient_bytes": 3 * 2**20}
        | ({"floor_ms": 0.004, "over_floor": 2.5} if p == "bole" else {}) for p, ms in (("serial", 0.04), ("bole", 0.01))
    ]  # fmt: skip
    _write(data / "kernels.jsonl", kernel_rows)
    kda_header = {"gpu": "NVIDIA H200", "torch": "2.11", "triton": "3.6", "transformers": "5.17", "fla": "0.6.0",
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
    # the oracle's runs: batch 256, and batch 512 and 1024 from another commit, which did not finish 1024
    sweep = {**SETTINGS, "model": "random 9B shape", "prompt_length": 128, "depth": [6], "chain_depth": [6],
             "oracle_accept": 0.8, "max_new_tokens": 64, "batch_sizes": [256]}  # fmt: skip
    gib = 2**30
    _write(data / "batch_sweep.jsonl", [
        {**_row("ar-static", 256, 2000.0, peak_memory_bytes=40 * gib), "settings": sweep},
        {**_row("chain", 256, 1500.0, acc=2.9, peak_memory_bytes=50 * gib), "settings": sweep},
        {**_row("bole", 256, 2600.0, acc=1.8, peak_memory_bytes=45 * gib, row_nodes=1,
                transient_bytes={"factors": 256 * 2**20, "conv_inputs": 0, "tree_kv": 0, "snapshots": 0},
                budget_source="table t.json at epsilon 0.3"), "settings": sweep},
    ])  # fmt: skip
    _write(data / "batch_sweep_big.jsonl", [
        {**_row(mode, 512, tps), "machine": {**MACHINE, "commit": "1111111"},
         "settings": {**sweep, "batch_sizes": [512, 1024]}} for mode, tps in (("ar-static", 2100.0), ("bole", 2800.0))
    ])  # fmt: skip
    _write(data / "batch_sweep_mtp.jsonl", [
        {**_row("chain", 256, 900.0), "settings": {**sweep, "drafter": "mtp"}},
        {**_row("bole bauto", 256, 1900.0, row_nodes=0, peak_memory_bytes=44 * gib),
         "settings": {**sweep, "drafter": "mtp"}},
        {**_row("bole b0", 256, 1900.0, row_nodes=0), "settings": {**sweep, "drafter": "mtp"}},
    ])  # fmt: skip
    # the shipped tables: one of the house model's shape, and one of an older format, which generate does not read
    from hf_bole.generation import budget
    from eval.shapes import shape_config

    shipped = tmp_path / "shipped"
    monkeypatch.setattr(budget, "PACKAGE_TABLES", shipped)
    key = budget.TableKey(budget.model_key(shape_config("house")), "NVIDIA H200", "bfloat16", "closed_form", "graphs")
    entry = budget.BudgetEntry(1, 1024, [0, 1, 3], [1.0, 1.05, 1.1], 0.1, 3)
    budget.BudgetTable(key, 0.3, [entry], {"versions": {"torch": "2.11"}, "created": "2026-12-06"}).save(
        shipped / key.filename
    )
    (shipped / "old.json").write_text(json.dumps({"format": 4}))
    tp = {**SETTINGS, "shape": "122B-A10B", "tensor_parallel": 2, "device_map": None}
    _write(data / "ttft_turn2.jsonl", [TTFT])
    _write(data / "host.jsonl", [{"header": MACHINE}, {
        "op": "host", "B": 16, "T": 64, "H": 32, "HK": 16, "K": 128, "V": 128, "device": "cuda", "verify_us": 90.0,
        "verify_triton_us": 260.0, "checks_us": 6.0, "launches_us": 40.0, "allocations_us": 12.0, "ancestors_us": 30.0,
        "ancestors_triton_us": 55.0,
    }])  # fmt: skip
    _write(data / "e2e_122b_tp_b1.jsonl", [
        {**_row("ar", 1, 10.0), "settings": tp}, {**_row("bole", 1, 35.0, acc=4.0, exact=1.0), "settings": tp}
    ])  # fmt: skip
    kimi = {**SETTINGS, "model": "random Kimi-Linear-48B-A3B-16L shape", "prompt_length": 128, "depth": [6],
            "drafter": "oracle", "oracle_accept": 0.8}  # fmt: skip
    _write(data / "e2e_kimi_b1.jsonl", [
        {**_row("ar", 1, 30.0, ttft_ms=60.0, peak_memory_bytes=54 * gib), "settings": kimi},
        {**_row("bole", 1, 210.0, acc=4.0, exact=1.0, ttft_ms=36.0, peak_memory_bytes=53 * gib, budget_source="fallback",
                transient_bytes={"factors": 20 * 2**20, "conv_inputs": 0, "tree_kv": 0, "snapshots": 0}),
         "settings": kimi},
    ])  # fmt: skip
    render.main()
    text = doc.read_text()
    # a KDA model's run: bole against plain generate, the oracle's acceptance named; the n-gram runs not there
    assert "| mbpp | 1 | 30.0 | 210.0 | 7.00× | 4.00 | 60.0 / 36.0 | 54.0 / 53.0 | 20.00 | 100% |" in text
    assert "drafter oracle (accepts a level with probability 0.8)" in text and "old e2e_kimi_b1_ngram" in text
    assert "| 122B-A10B | tensor parallel over 2 GPUs | 1 | 10.0 | 35.0 | 3.50× | 4.00 | 100% |" in text
    # e2e: every mode's tokens/s, a failed mode's error, bole against each baseline, where the budget came from
    assert "| mbpp | 1 | 100.0 | 500.0 | 2000.0 | out of memory | 2500.0 | 5.000× | 1.250× | – | 6.50 / – / 8.00 |" in text
    assert "75% / 100% / – / 100%" in text and "bole: table x.json" in text
    assert "commit `0000000`, a commit this clone's history lacks: not known to be the current code" in text
    assert "| 32 | 1 | 16 | 0.040 | – | 0.010 | 4.0× | – | 0.0040 | 2.5× | 32 | 3.0 |" in text and "commit unknown" in text
    assert "| 8 | 900.0 | **1000.0** | 990.0 | 0.99 |" in text and "the house model, mbpp" in text
    assert "| 1 | 64 | 8 | 0.100 | 0.025 | 0.020 | 0.010 | 0.80× | 5.00× | 1.0 | – |" in text
    assert "largest error 2.0e-06" in text  # fla's own distance from float64 is not ours
    assert "old e2e_9b_b1" in text and "old budget_9b" in text  # no data: left as it was
    # the batch sweep: the oracle's run, then the MTP head's against the oracle run's ar-static
    assert "| 256 | 2000.0 | 1500.0 | 2600.0 | 1.30× | 1.73× | 2.90 / 1.80 | 1 | 40.0 / 50.0 / 45.0 | 1.00 |" in text
    assert "| 256 | 900.0 | 1900.0 | 1900.0 | 2000.0 | 0.95× | 0.95× | 0 | 44.0 |" in text
    assert "| 512 | 2100.0 | – | 2800.0 | 1.33× |" in text and "- batch 512: **NVIDIA H200**" in text
    assert text.count("Asked for but not in the runs' results") == 1 and "results: batch 1024." in text
    assert "budget from table t.json" in text
    assert "| hf_bole, from a copy | 10.0 (9.0) | 80.0 (72.0) | 8.00× (8.00×) | yes |" in text
    kept = "| hf_bole, from the cache turn 1 returned (a chat loop's) | 8.0 (7.0) | 80.0 (72.0) | 10.00× (10.29×) |"
    assert kept in text
    assert "| plain `generate`, from a copy | 50.0 (50.0) | 75.0 (75.0) | 1.50× (1.50×) | no |" in text
    assert "| 16 | 64 | 90.0 | 260.0 | 6.0 | 40.0 | 12.0 | 30.0 | 55.0 |" in text and "H = 32, K = V = 128" in text
    assert "| house model | NVIDIA H200 | bfloat16 | closed_form | graphs | 1: 3 | 1024 |" in text
    assert "| `old.json` | | | | | not read: budget table format 4 is not 5: calibrate again |" in text
    assert (data / "speedup.png").stat().st_size > 0
    assert "| house | mbpp | 1 | 100.0 | 500.0 | 2000.0 | out of memory | 2500.0 | 5.00× | 1.25× |" in readme.read_text()


def test_ttft_runs_without_the_kept_arm_render_without_its_row():
    line = {**TTFT, **{k: {arm: v for arm, v in TTFT[k].items() if arm != "bole-kept"} for k in TTFT_PER_ARM}}
    text = "\n".join(render.ttft_turn2([line]))
    assert "| hf_bole, from a copy | 10.0 (9.0) |" in text and "chat loop" not in text
    assert "each arm's cache copied (and the garbage collected)" in text


def test_provenance_labels_each_machine_where_there_are_several():
    """A machine line per commit, labelled with what it ran where there are several, unlabelled where there is one."""
    old = _row("ar", 1, 100.0)
    new = {**_row("ar", 1, 90.0), "dataset": "gsm8k", "machine": {**MACHINE, "commit": "1111111"}}
    lines = render.provenance([old, new])
    assert len(lines) == 2
    assert lines[0].startswith("- mbpp: **NVIDIA H200**") and lines[1].startswith("- gsm8k: **NVIDIA H200**")
    assert render.provenance([old])[0].startswith("- **NVIDIA H200**")


def test_currency_counts_library_commits_not_budget_tables(tmp_path, monkeypatch):
    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                              capture_output=True, text=True).stdout.strip()  # fmt: skip

    def commit(path, text):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
        git("add", path)
        git("commit", "-q", "-m", path)
        return git("rev-parse", "--short", "HEAD")

    git("init", "-q")
    measured = commit("hf_bole/loop.py", "a")
    monkeypatch.setattr(render, "REPO", tmp_path)
    commit("hf_bole/budgets/h200.json", "{}")  # a GPU's budget table: data, not the measured code
    commit("eval/run.py", "b")
    assert render.currency(measured) == "hf_bole/ unchanged since: the current code"
    commit("hf_bole/loop.py", "c")
    assert render.currency(measured) == "hf_bole/ changed in 1 commit since: **not the current code**"
    assert render.currency("deadbee").endswith("not known to be the current code")
    assert render.currency(None).startswith("commit unknown")
