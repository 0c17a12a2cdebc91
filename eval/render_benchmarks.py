"""Rewrites BENCHMARKS.md's tables, README.md's results table and the speed-up plot (benchmarks/speedup.png) from
the JSONL in benchmarks/.

    python eval/render_benchmarks.py

Each table sits between `<!-- rendered: NAME -->` and `<!-- end: NAME -->` in BENCHMARKS.md and is rendered from
`benchmarks/NAME.jsonl` (the shipped budget tables from `hf_bole/budgets/*.json`); a table whose file is missing is
left as it is; README.md's `readme_results` section summarises the end-to-end tables. Above each table: the GPU,
the versions and the commit of every run behind it, and whether the library (`hf_bole/`) has changed since that
commit in this clone's history (then the table is not of the current code).
`bash eval/gpu.sh` runs this after its measuring parts.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from eval import report  # noqa: E402

DATA = REPO / "benchmarks"
DOC = REPO / "BENCHMARKS.md"
README = REPO / "README.md"
E2E = ("e2e_house_b1", "e2e_house_b8", "e2e_9b_b1", "e2e_9b_b8_b16")
# The KDA models' runs (eval/gpu.sh kimi1, ling1): their own section, outside README's summary and the plot
KDA_E2E = ("e2e_kimi_b1", "e2e_kimi_b1_ngram", "e2e_ling_b1", "e2e_ling_b1_ngram")
BUDGETS = ("budget_house", "budget_9b")
# the oracle's runs (ar-static among their modes), the MTP head's: batch 1 to 64, and 128 and 256 in a run of their own
SWEEP = (("batch_sweep", "batch_sweep_big"), ("batch_sweep_mtp", "batch_sweep_mtp_big"))
# Models larger than one GPU (eval/gpu.sh tp122-1, tp122-8, dm122-1, dm122-8, tp27): one table, a row per layout and
# batch size.
LAYOUTS = ("e2e_122b_tp_b1", "e2e_122b_tp_b8", "e2e_122b_dm_b1", "e2e_122b_dm_b8", "e2e_27b_tp2_b1", "e2e_27b_1gpu_b1")
MODES = ("ar", "ar-static", "chain", "tree-serial", "bole")


def load(name: str) -> list[dict]:
    path = DATA / f"{name}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def currency(commit: str | None) -> str:
    """Whether hf_bole/ changed after `commit`, by this clone's history. The shipped budget tables (hf_bole/budgets/)
    are not counted: each is data measured on one GPU, and a run's rows name the table they used (budget_source)."""
    if not commit:
        return "commit unknown: not known to be the current code"
    count = subprocess.run(
        ["git", "rev-list", "--count", f"{commit}..HEAD", "--", "hf_bole", ":(exclude)hf_bole/budgets"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if count.returncode != 0:
        return "a commit this clone's history lacks: not known to be the current code"
    n = int(count.stdout.strip())
    if n == 0:
        return "hf_bole/ unchanged since: the current code"
    return f"hf_bole/ changed in {n} commit{'s' * (n > 1)} since: **not the current code**"


def machine_line(m: dict, what: str = "") -> str:
    versions = f"torch {m.get('torch')}, triton {m.get('triton')}, transformers {m.get('transformers')}"
    if "fla" not in m:
        versions += ", fla-core not recorded"
    else:
        versions += f", fla-core {m['fla']}" if m["fla"] else ", no fla-core"
    commit = (m.get("commit") or "?")[:7]
    dirty = " (dirty)" if m.get("dirty") else ""
    # older records hold only the architecture (x86_64), which says nothing of the host's speed
    host = f" (host {m['cpu']})" if m.get("cpu") and m["cpu"] not in ("x86_64", "aarch64", "arm64") else ""
    return f"- {what}**{m.get('gpu')}**{host}, {versions}; commit `{commit}`{dirty}, {currency(m.get('commit'))}."


MACHINE_FIELDS = ("gpu", "cpu", "torch", "triton", "transformers", "fla", "commit", "dirty")


def provenance(rows: list[dict], label=lambda r: r["dataset"]) -> list[str]:
    """One line per distinct machine and commit, naming what it ran (`label` of its rows: the datasets)."""
    groups: dict[str, list[str]] = {}
    for r in rows:
        key = json.dumps({k: r["machine"][k] for k in MACHINE_FIELDS if k in r["machine"]})
        if label(r) not in groups.setdefault(key, []):
            groups[key].append(label(r))
    return [
        machine_line(json.loads(key), f"{', '.join(datasets)}: " if len(groups) > 1 else "")
        for key, datasets in groups.items()
    ]


def _f(x, spec: str = ".1f") -> str:
    return "–" if x is None else format(x, spec)


def _cells(rows: list[dict]) -> dict[tuple[str, int], dict[str, dict]]:
    """`{(dataset, batch size): {mode: row}}`, in the rows' order."""
    cells: dict[tuple[str, int], dict[str, dict]] = {}
    for r in rows:
        cells.setdefault((r["dataset"], r["batch_size"]), {})[r["mode"].split()[0]] = r
    return cells


def _tps(row: dict | None) -> str:
    """A run's tokens/s, or its error ("out of memory"), or "–" where it did not run."""
    if row is None:
        return "–"
    return row.get("error") or _f(row.get("output_tokens_per_s"))


def _over(row: dict | None, base: dict | None, spec: str = ".2f") -> str:
    """`row`'s tokens/s over `base`'s, or "–" where either did not run or failed."""
    if any(not r or r.get("error") or not r.get("output_tokens_per_s") for r in (row, base)):
        return "–"
    return f"{row['output_tokens_per_s'] / base['output_tokens_per_s']:{spec}}×"


def _tokens_per_s(by_mode: dict[str, dict]) -> list[str]:
    """Each mode's `_tps`."""
    return [_tps(by_mode.get(m)) for m in MODES]


def e2e(rows: list[dict]) -> list[str]:
    s = rows[0]["settings"]
    timing = f"median of {s.get('repeats')} passes" + (" taken in turns" if s.get("interleave") else "")
    sources: dict[str, set[str]] = {}
    for r in rows:
        if r.get("budget_source"):
            sources.setdefault(r["mode"].split()[0], set()).add(r["budget_source"].split(" at epsilon")[0])
    budget = "; ".join(f"{m}: {', '.join(sorted(v))}" for m, v in sources.items()) or "as set"
    lines = provenance(rows) + [
        f"- {s.get('dtype')}, greedy, {rows[0]['num_prompts']} prompts a row, at most {s.get('max_new_tokens')} new "
        f"tokens, drafter {s.get('drafter')}; bole and tree-serial depth {s['depth'][0]}, top-{s.get('topk')}; chain "
        f"depth {(s.get('chain_depth') or [3])[0]}; budget {s['budget'][0]} (ε {s['epsilon'][0]}), from {budget}; "
        f"CUDA graphs {'on' if s.get('cuda_graphs', True) else 'off'}; tokens/s over the generate calls' wall time, "
        f"prefill included, {timing}.",
        "",
        "| dataset | batch | " + " | ".join(MODES) + " | bole ÷ ar-static | bole ÷ chain | bole ÷ tree-serial "
        "| tokens a round (chain / tree-serial / bole) | outputs equal to ar (ar-static / chain / tree-serial / bole) |",
        "|---|---:|" + "---:|" * (len(MODES) + 3) + "---|---|",
    ]
    for (dataset, batch), by_mode in _cells(rows).items():
        ratios = [_over(by_mode.get("bole"), by_mode.get(m), ".3f") for m in ("ar-static", "chain", "tree-serial")]
        rounds = [_f(by_mode[m].get("mean_accepted_tokens"), ".2f") if m in by_mode else "–"
                  for m in ("chain", "tree-serial", "bole")]  # fmt: skip
        shares = [by_mode.get(m, {}).get("exact_share") for m in MODES[1:]]
        exact = ["–" if share is None else f"{100 * share:.0f}%" for share in shares]
        cells = [dataset, batch, *_tokens_per_s(by_mode), *ratios, " / ".join(rounds), " / ".join(exact)]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return lines


def kda_e2e(rows: list[dict]) -> list[str]:
    """A KDA model's run: ar (plain generate) and bole, one line per prompt set and batch size."""
    s = rows[0]["settings"]
    timing = f"median of {s.get('repeats')} passes" + (" taken in turns" if s.get("interleave") else "")
    sources = sorted({r["budget_source"].split(" at epsilon")[0] for r in rows if r.get("budget_source")})
    lines = provenance(rows) + [
        f"- {s.get('model')}, {s.get('dtype')}, greedy, {rows[0]['num_prompts']} prompts of {s.get('prompt_length')} "
        f"tokens, at most {s.get('max_new_tokens')} new tokens, drafter {s.get('drafter')}"
        + (f" (accepts a level with probability {s.get('oracle_accept')})" if s.get("drafter") == "oracle" else "")
        + f"; bole depth "
        f"{s['depth'][0]}, top-{s.get('topk')}, budget {s['budget'][0]} from {', '.join(sources) or 'as set'}; CUDA "
        f"graphs {'on' if s.get('cuda_graphs', True) else 'off'}; tokens/s over the generate calls' wall time, prefill "
        f"included, {timing}. Tree state: the round's factors, pre-conv inputs and tree KV per request.",
        "",
        "| dataset | batch | ar tokens/s | bole tokens/s | bole ÷ ar | tokens a round | TTFT ms (ar / bole) "
        "| peak GiB (ar / bole) | tree state MiB | outputs equal to ar |",
        "|---|---:|---:|---:|---:|---:|---|---|---:|---|",
    ]
    for (dataset, batch), by_mode in _cells(rows).items():
        ar, bole = by_mode.get("ar"), by_mode.get("bole")
        share = (bole or {}).get("exact_share")
        cells = [
            dataset, batch, _tps(ar), _tps(bole), _over(bole, ar), _f((bole or {}).get("mean_accepted_tokens"), ".2f"),
            " / ".join(_f((r or {}).get("ttft_ms")) for r in (ar, bole)), " / ".join(_gib(r) for r in (ar, bole)),
            _tree_per_request(bole), "–" if share is None else f"{100 * share:.0f}%",
        ]  # fmt: skip
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return lines


def _by_label(rows: list[dict]) -> dict[int, dict[str, dict]]:
    """`{batch size: {mode label: row}}`."""
    cells: dict[int, dict[str, dict]] = {}
    for r in rows:
        cells.setdefault(r["batch_size"], {})[r["mode"]] = r
    return cells


def _gib(row: dict | None) -> str:
    return _f(row["peak_memory_bytes"] / 2**30, ".1f") if row and row.get("peak_memory_bytes") else "–"


def _tree_per_request(row: dict | None) -> str:
    """The round's tree state (`transient_bytes`, the peak over the rounds) per request, in MiB."""
    if not row or not row.get("transient_bytes"):
        return "–"
    return _f(sum(row["transient_bytes"].values()) / row["batch_size"] / 2**20, ".2f")


def batch_sweep(oracle: list[dict], mtp: list[dict]) -> list[str]:
    """Batch 1 to 256: tokens/s of ar-static, chain and bole with the oracle drafter, then with a random MTP head
    (what drafting costs) and bole at budget 0 (plain decoding through hf_bole's loop), each against ar-static."""
    rows = oracle + mtp
    s = (oracle or mtp)[0]["settings"]
    timing = f"median of {s.get('repeats')} passes" + (" taken in turns" if s.get("interleave") else "")
    budgets = sorted({r["budget_source"].split(" at epsilon")[0] for r in rows if r.get("budget_source")})
    lines = provenance(rows, lambda r: f"batch {r['batch_size']}") + [
        f"- {s.get('model')}, {s.get('dtype')}, greedy, random prompts of {s.get('prompt_length')} tokens, one batch "
        f"per batch size, at most {s.get('max_new_tokens')} new tokens; bole depth {s['depth'][0]}, "
        f"top-{s.get('topk')}, budget from {', '.join(budgets) or 'as set'}; chain depth "
        f"{(s.get('chain_depth') or [3])[0]} (every request's chain verified); tokens/s over the generate calls' wall time, prefill included, {timing}. "
        "\"nodes a row\": the most draft nodes \"auto\" gives a row at that batch size (0: plain decoding). Tree "
        "state: the round's GDN factors, pre-conv inputs and tree KV per request, at the widest round.",
    ]
    base = {b: cells.get("ar-static") for b, cells in _by_label(oracle).items()}
    if oracle:
        lines += [
            "",
            "Oracle drafter (accepts a level with probability "
            f"{oracle[0]['settings'].get('oracle_accept')}):",
            "",
            "| batch | ar-static | chain | bole | bole ÷ ar-static | bole ÷ chain | tokens a round (chain / bole) "
            "| nodes a row | peak GiB (ar-static / chain / bole) | tree state MiB a request |",
            "|---:|---:|---:|---:|---:|---:|---|---:|---|---:|",
        ]
        for batch, cells in sorted(_by_label(oracle).items()):
            chain, bole = cells.get("chain"), cells.get("bole")
            rounds = " / ".join(_f((r or {}).get("mean_accepted_tokens"), ".2f") for r in (chain, bole))
            peaks = " / ".join(_gib(r) for r in (base[batch], chain, bole))
            cells_ = [batch, _tps(base[batch]), _tps(chain), _tps(bole), _over(bole, base[batch]), _over(bole, chain),
                      rounds, _f((bole or {}).get("row_nodes"), "d"), peaks, _tree_per_request(bole)]  # fmt: skip
            lines.append("| " + " | ".join(map(str, cells_)) + " |")
        lines += _unfinished(oracle)
    if mtp:
        lines += [
            "",
            "A random MTP head (its drafts are next to never accepted: what drafting costs), and bole at budget 0:",
            "",
            "| batch | chain | bole | bole at budget 0 | ar-static | bole ÷ ar-static | budget 0 ÷ ar-static "
            "| nodes a row | peak GiB (bole) |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for batch, cells in sorted(_by_label(mtp).items()):
            chain = cells.get("chain")
            bole = cells.get("bole") or cells.get("bole bauto")
            plain = cells.get("bole b0")
            ar_static = base.get(batch)
            cells_ = [batch, _tps(chain), _tps(bole), _tps(plain), _tps(ar_static), _over(bole, ar_static),
                      _over(plain, ar_static), _f((bole or {}).get("row_nodes"), "d"), _gib(bole)]  # fmt: skip
            lines.append("| " + " | ".join(map(str, cells_)) + " |")
        lines += _unfinished(mtp)
    return lines


def _unfinished(rows: list[dict]) -> list[str]:
    """A line naming the batch sizes the runs asked for that their results lack (a run cut short keeps what it
    finished)."""
    asked = sorted({b for r in rows for b in r["settings"].get("batch_sizes", [])})
    missing = [b for b in asked if b not in {r["batch_size"] for r in rows}]
    return ["", f"Asked for but not in the runs' results: batch {', '.join(map(str, missing))}."] if missing else []


def layout(settings: dict) -> str:
    """Where a run's model sat: tensor-parallel over N processes, spread by accelerate's device map, or one GPU."""
    if settings.get("tensor_parallel", 1) > 1:
        return f"tensor parallel over {settings['tensor_parallel']} GPUs"
    return "device_map='auto'" if settings.get("device_map") else "one GPU"


def layouts(rows: list[dict]) -> list[str]:
    """The runs of models larger than one GPU: per shape, layout and batch size, ar's and bole's tokens/s."""
    lines = provenance(rows) + [
        "- bf16, greedy, oracle drafter, bole depth 6; tokens/s over the generate calls' wall time, prefill included, "
        "median of the passes taken in turns (ar and bole alternate); ar is plain `generate` in the same layout.",
        "",
        "| shape | layout | batch | ar | bole | bole ÷ ar | tokens a round | outputs equal to ar |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r["mode"].split()[0] != "bole":
            continue
        ar = next((a for a in rows if a["mode"] == "ar" and a["settings"] == r["settings"]
                   and a["batch_size"] == r["batch_size"]), {})  # fmt: skip
        cells = [
            r["settings"].get("shape"), layout(r["settings"]), r["batch_size"],
            ar.get("error") or _f(ar.get("output_tokens_per_s")), r.get("error") or _f(r.get("output_tokens_per_s")),
            _over(r, ar), _f(r.get("mean_accepted_tokens"), ".2f"),
            "–" if r.get("exact_share") is None else f"{100 * r['exact_share']:.0f}%",
        ]  # fmt: skip
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return lines


def summary(runs: dict[str, list[dict]]) -> list[str]:
    """README's table: every end-to-end run's tokens/s by mode, one line per model, prompts and batch size."""
    def model(name: str) -> str:
        return "house" if "house" in name else "9B shape"

    def label(r: dict) -> str:  # the 9B shape runs on random prompts
        return r["readme_model"] if r["dataset"] == "random" else f"{r['readme_model']} {r['dataset']}"

    tagged = [{**r, "readme_model": model(name)} for name, rows in runs.items() for r in rows]
    lines = provenance(tagged, label) + [
        "",
        "| model | prompts | batch | " + " | ".join(MODES) + " | bole ÷ ar-static | bole ÷ chain |",
        "|---|---|---:|" + "---:|" * (len(MODES) + 2),
    ]
    for name, rows in runs.items():
        for (dataset, batch), by_mode in _cells(rows).items():
            ratios = [_over(by_mode.get("bole"), by_mode.get(m)) for m in ("ar-static", "chain")]
            cells = [model(name), dataset, batch, *_tokens_per_s(by_mode), *ratios]
            lines.append("| " + " | ".join(map(str, cells)) + " |")
    return lines


def kernels(rows: list[dict]) -> list[str]:
    head = rows[0]
    h = head["header"]
    verify = [r for r in rows[1:] if r.get("op") == "verify"]
    commit = next((r for r in rows[1:] if r.get("op") == "commit"), None)
    lines = [
        machine_line({**h, "fla": h.get("fla")}),
        f"- One GDN layer: Hk = {verify[0]['HK']} key heads, K = V = {verify[0]['K']}, bf16 q/k/v, fp32 state, random "
        f"trees re-hung to depth ≤ {verify[0]['depth']}, products at {verify[0]['precision']}; each time the median of "
        "CUDA-graph replays over rotating inputs (3× the L2 cache), correctness checked against float64 first.",
        "",
        "| value heads | batch | tree nodes | serial ms | fla chain ms | bole ms | serial ÷ bole | fla chain ÷ bole "
        "| floor ms | bole ÷ floor | snapshots MiB | bole factors MiB |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    shapes = list(dict.fromkeys((r["H"], r["B"], r["T"]) for r in verify))
    for H, B, T in shapes:
        by = {r["provider"]: r for r in verify if (r["H"], r["B"], r["T"]) == (H, B, T)}
        ms = {p: by[p].get("ms") for p in ("serial", "fla", "bole") if p in by}
        cell = lambda p: "OOM" if by.get(p, {}).get("oom") else _f(ms.get(p), ".3f")  # noqa: E731
        over = lambda p: f"{ms[p] / ms['bole']:.1f}×" if ms.get(p) and ms.get("bole") else "–"  # noqa: E731
        snap = B * T * H * verify[0]["K"] * verify[0]["V"] * 4 / 2**20
        factors = by.get("bole", {}).get("transient_bytes")
        floor, over_floor = by.get("bole", {}).get("floor_ms"), by.get("bole", {}).get("over_floor")
        lines.append(f"| {H} | {B} | {T} | {cell('serial')} | {cell('fla')} | {cell('bole')} | {over('serial')} | "
                     f"{over('fla')} | {_f(floor, '.4f')} | {_f(over_floor, '.1f')}{'×' if over_floor else ''} | "
                     f"{snap:.0f} | {_f(factors / 2**20 if factors else None, '.1f')} |")  # fmt: skip
    if commit:
        lines += ["", f"Commit (Eq. 10) of all {commit['NL']} GDN layers at once, batch {commit['B']}, {commit['H']} "
                  f"value heads, an accepted path of {commit['L']}: {commit['ms']:.3f} ms ({commit['GBps']:.0f} GB/s, "
                  f"{commit['pct_of_copy']:.0f}% of a device copy's)."]  # fmt: skip
    return lines


def kda(rows: list[dict]) -> list[str]:
    """eval/bench_kda.py's lines: a header, then one line per (shape, provider)."""
    head, timed = rows[0], rows[1:]
    h = head["header"]
    lines = [
        machine_line(h),
        f"- One KDA layer of Kimi-Linear-48B-A3B: H = {head['H']} heads, K = V = {head['K']}, bf16 q/k/v, fp32 gates "
        f"and state, random trees of depth ≤ the column's, products at {head['precision']}; each time the median of "
        "CUDA-graph replays over rotating inputs; correctness against float64 first (largest error "
        f"{max(v for k, v in head['errors'].items() if not k.startswith('fla')):.1e}).",
        "",
        "| batch | tree nodes | depth | serial ms | fla chunk (chain) ms | bole ms | commit ms | bole ÷ fla chain "
        "| serial ÷ bole | bole MiB | serial MiB |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for B, T, depth in dict.fromkeys((r["B"], r["T"], r["depth"]) for r in timed):
        by = {r["provider"]: r for r in timed if (r["B"], r["T"], r["depth"]) == (B, T, depth)}
        ms = lambda p: by.get(p, {}).get("ms")  # noqa: E731
        cell = lambda p: "OOM" if by.get(p, {}).get("oom") else _f(ms(p), ".3f")  # noqa: E731
        ratio = lambda a, b: f"{ms(a) / ms(b):.2f}×" if ms(a) and ms(b) else "–"  # noqa: E731
        mib = lambda p: _f((by.get(p, {}).get("transient_bytes") or 0) / 2**20 or None, ".1f")  # noqa: E731
        lines.append(f"| {B} | {T} | {depth} | {cell('serial')} | {cell('fla-chunk')} | {cell('bole')} | "
                     f"{cell('commit')} | {ratio('bole', 'fla-chunk')} | {ratio('serial', 'bole')} | {mib('bole')} | "
                     f"{mib('serial')} |")  # fmt: skip
    return lines


def _model(settings: dict) -> str:
    return "the house model" if report.is_house(settings["model"]) else settings["model"]


def budgets(rows: list[dict]) -> list[str]:
    cells = report.budget_cells(rows)
    s = rows[0]["settings"]
    prompts = "random prompts" if rows[0]["dataset"] == "random" else rows[0]["dataset"]
    looked_up = (r.get("budget_source") or "" for r in rows)
    sources = sorted({b.split(" at epsilon")[0] for b in looked_up if b.startswith(("table", "fallback"))})
    auto = f"\"auto\" read {', '.join(sources)}" if sources else "\"auto\" read the table calibrated on that GPU"
    labels = sorted({b for v in cells.values() for b in v if isinstance(b, int)})
    rules = sorted({b for v in cells.values() for b in v if not isinstance(b, int)})
    timing = f"median of {s.get('repeats')} passes" + (" taken in turns" if s.get("interleave") else "")
    lines = provenance(rows) + [
        f"- {_model(s)}, {prompts}, {rows[0]['num_prompts']} prompts, at most {s.get('max_new_tokens')} new tokens, "
        f"{s.get('dtype')}, greedy, drafter {s.get('drafter')}, bole depth {s['depth'][0]}; tokens/s, {timing}; {auto}.",
        "",
        "| batch | " + " | ".join(f"{b} nodes" for b in labels) + " | " + " | ".join(rules) + " | "
        + " | ".join(f"{r} ÷ best fixed" for r in rules) + " |",
        "|---:|" + "---:|" * (len(labels) + 2 * len(rules)),
    ]
    for (_, _, _, batch), tps in sorted(cells.items(), key=lambda kv: -kv[0][3]):
        best = max(t for b, t in tps.items() if isinstance(b, int))
        fixed = [f"**{tps[b]:.1f}**" if tps.get(b) == best else _f(tps.get(b)) for b in labels]
        lines.append(f"| {batch} | " + " | ".join(fixed) + " | " + " | ".join(_f(tps.get(r)) for r in rules) + " | "
                     + " | ".join(f"{tps[r] / best:.2f}" if tps.get(r) else "–" for r in rules) + " |")  # fmt: skip
    return lines


def shipped_tables() -> list[str]:
    from hf_bole.generation.budget import PACKAGE_TABLES, BudgetTable, entry_budget, model_key
    from hf_bole.shapes import SHAPES, available, shape_config

    from eval.shapes import shape_config as eval_shape_config

    names = {model_key(shape_config(name)): name for name in SHAPES if available(name)}
    names[model_key(eval_shape_config("house"))] = "house model"
    lines = [
        "| model | GPU | dtype | verify | launch | budget at ε = 0.3 by batch size | KV length | measured with |",
        "|---|---|---|---|---|---|---:|---|",
    ]
    for path in sorted(PACKAGE_TABLES.glob("*.json")):
        try:
            t = BudgetTable.load(path)
        except ValueError as unreadable:  # an older format: generate skips it too, until it is measured again
            lines.append(f"| `{path.name}` | | | | | not read: {unreadable} | | |")
            continue
        entries = sorted(t.entries, key=lambda e: e.batch_size)
        by_batch = " / ".join(f"{e.batch_size}: {entry_budget(e, 0.3)}" for e in entries)
        kv = ", ".join(map(str, sorted({e.kv_length for e in t.entries})))
        v = t.meta.get("versions", {})
        made = f"torch {v.get('torch')}, transformers {v.get('transformers')}, {t.meta.get('created', '?')[:10]}"
        lines.append(f"| {names.get(t.key.model, t.key.model)} | {t.key.device} | {t.key.dtype} | {t.key.verify} | "
                     f"{t.key.launch} | {by_batch} | {kv} | {made} |")  # fmt: skip
    return lines


def plot(runs: dict[str, list[dict]], path: Path) -> Path | None:
    """Tokens/s over ar's, per mode and batch size, one panel per model and prompt set."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: dict[str, dict[tuple[str, int], float]] = {}  # "model, prompts" -> (mode, batch) -> speed-up
    for name, rows in runs.items():
        model = "house model" if "house" in name else "random 9B shape, oracle drafter"
        for r in rows:
            base = _cells(rows)[r["dataset"], r["batch_size"]].get("ar", {})
            if r["mode"] != "ar" and r.get("output_tokens_per_s") and base.get("output_tokens_per_s"):
                speedup = r["output_tokens_per_s"] / base["output_tokens_per_s"]
                panels.setdefault(f"{model}, {r['dataset']}", {})[(r["mode"].split()[0], r["batch_size"])] = speedup
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False, sharey=True)
    for ax, (title, values) in zip(axes[0], panels.items()):
        batches = sorted({b for _, b in values})
        modes = [m for m in MODES[1:] if any(k[0] == m for k in values)]
        width = 0.8 / len(modes)
        for k, mode in enumerate(modes):
            xs = [i + k * width for i in range(len(batches))]
            ax.bar(xs, [values.get((mode, b), 0) for b in batches], width=width, label=mode)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(batches))], [f"batch {b}" for b in batches])
        ax.set(title=title, yscale="log")
        ax.axhline(1.0, color="gray", linewidth=0.8)
    axes[0][0].set_ylabel("tokens/s ÷ plain generate (ar)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize="small")
    measured = sorted({f"{r['machine'].get('gpu')}, commit {(r['machine'].get('commit') or '?')[:7]}"
                       for rows in runs.values() for r in rows})  # fmt: skip
    fig.suptitle("; ".join(measured) + " (BENCHMARKS.md)", fontsize="small")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def host(rows: list[dict]) -> list[str]:
    """The host time of an eager `tree_gdn_verify` and ancestor build, GPU idle (eval/bench_host.py: a header line,
    then one line per shape)."""
    header, shapes = rows[0]["header"], [r for r in rows if r.get("op") == "host"]
    lines = [
        machine_line(header),
        f"- One GDN layer of the 9B shape (Hk = {shapes[0]['HK']}, H = {shapes[0]['H']}, K = V = {shapes[0]['K']}, "
        "bf16 q/k/v, fp32 state), the ancestors given to the verify as a model passes them; microseconds of host time "
        "a call, the GPU idle before each pass, median of the passes.",
        "",
        "| batch | tree nodes | `tree_gdn_verify` µs | through Triton's launcher µs | its input checks µs | "
        "its two launches µs | its allocations µs | `tree_ancestor_mask` µs | through Triton's launcher µs |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in shapes:
        lines.append(f"| {r['B']} | {r['T']} | {r['verify_us']:.1f} | {r['verify_triton_us']:.1f} | "
                     f"{r['checks_us']:.1f} | {_f(r.get('launches_us'), '.1f')} | {_f(r.get('allocations_us'), '.1f')} | "
                     f"{r['ancestors_us']:.1f} | {r['ancestors_triton_us']:.1f} |")  # fmt: skip
    return lines


def ttft_turn2(rows: list[dict]) -> list[str]:
    """A conversation's second turn: time to the first new token continuing turn 1's cache (a copy of it, and for
    hf_bole the cache itself) against re-prefilling the whole conversation, hf_bole and plain `generate`
    (eval/ttft_turn2.py; the last run's line)."""
    r = rows[-1]
    ms = {arm: 1e3 * s for arm, s in r["median_s"].items()}
    same = r["same_tokens_as_bole_prefill"]
    prepared = "copied or brought back to turn 1's state" if "bole-kept" in ms else "copied"
    lines = [
        machine_line(r["machine"]),
        f"- random {r['shape']} shape, {r['dtype']}, one conversation: {r['history']} tokens after turn 1, turn 2 adds "
        f"{r['turn']} tokens and generates {r['new']} (n-gram drafter: random weights have no MTP head); from the "
        f"call to the first new token on the host (a streamer), median of {r['passes']} passes taken in turns, each "
        f"arm's cache {prepared} (and the garbage collected) outside the timed call; the fastest pass in brackets. "
        "Tokens compared with hf_bole's re-prefilled turn.",
        "",
        "| | continued from turn 1's cache, ms | re-prefilled, ms | re-prefilled ÷ continued | same tokens |",
        "|---|---:|---:|---:|---|",
    ]
    fastest = {arm: 1e3 * min(s) for arm, s in r["seconds"].items()}
    arms = [("hf_bole, from a copy", "bole-continued", "bole-prefill")]
    if "bole-kept" in ms:  # earlier runs timed the copied cache alone
        arms.append(("hf_bole, from the cache turn 1 returned (a chat loop's)", "bole-kept", "bole-prefill"))
    arms.append(("plain `generate`, from a copy", "plain-continued", "plain-prefill"))
    for name, cont, pre in arms:
        agree = "yes" if same[cont] and same[pre] else "no"
        lines.append(f"| {name} | {ms[cont]:.1f} ({fastest[cont]:.1f}) | {ms[pre]:.1f} ({fastest[pre]:.1f}) | "
                     f"{ms[pre] / ms[cont]:.2f}× ({fastest[pre] / fastest[cont]:.2f}×) | {agree} |")  # fmt: skip
    return lines


def replace(doc: str, name: str, lines: list[str], where: str = DOC.name) -> str:
    pattern = re.compile(rf"(<!-- rendered: {name} -->\n).*?(<!-- end: {name} -->)", re.S)
    if not pattern.search(doc):
        raise SystemExit(f"{where} has no <!-- rendered: {name} --> ... <!-- end: {name} --> section")
    return pattern.sub(lambda m: m.group(1) + "\n".join(lines) + "\n" + m.group(2), doc)


def main() -> None:
    doc = DOC.read_text()
    runs = {name: rows for name in E2E if (rows := load(name))}
    for name, rows in runs.items():
        doc = replace(doc, name, e2e(rows))
    for name in KDA_E2E:
        if rows := load(name):
            doc = replace(doc, name, kda_e2e(rows))
    if rows := [r for name in LAYOUTS for r in load(name)]:
        doc = replace(doc, "layouts", layouts(rows))
    for name in ("kernels", "kernels_h200"):  # the same table on each GPU
        if rows := load(name):
            doc = replace(doc, name, kernels(rows))
    if rows := load("host"):
        doc = replace(doc, "host", host(rows))
    if rows := load("kda"):
        doc = replace(doc, "kda", kda(rows))
    for name in BUDGETS:
        if rows := load(name):
            doc = replace(doc, name, budgets(rows))
    if any(sweep := [[r for name in names for r in load(name)] for names in SWEEP]):
        doc = replace(doc, "batch_sweep", batch_sweep(*sweep))
    if rows := load("ttft_turn2"):
        doc = replace(doc, "ttft_turn2", ttft_turn2(rows))
    doc = replace(doc, "tables", shipped_tables())
    DOC.write_text(doc)
    print(f"wrote {DOC}")
    if runs:
        README.write_text(replace(README.read_text(), "readme_results", summary(runs), README.name))
        print(f"wrote {README}")
    if (png := plot(runs, DATA / "speedup.png")) is not None:
        print(f"wrote {png}")


if __name__ == "__main__":
    main()
