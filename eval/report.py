"""What a run leaves behind: `results.jsonl` (one line per (dataset, mode, batch size), with the machine and every
setting), `results.md` (the table), and PNG plots (throughput vs batch size, accepted-length histograms, speedup
over `ar`, and a budget sweep's throughput against its best fixed budget)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path

import torch

from eval.modes import CHAIN_DEPTH

REPO = Path(__file__).resolve().parents[1]


def cpu_model() -> str:
    """The host CPU's model name (Linux's /proc/cpuinfo), else the architecture: host-bound timings (eager decoding,
    a kernel call's launch) move with it as much as with the GPU."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    """Hardware and software versions, as every JSONL line records them."""
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    try:
        import fla

        fla_version = getattr(fla, "__version__", "installed")
    except ImportError:
        fla_version = None
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    # BOLE_COMMIT names the working tree's commit where the checkout's git does not (a copy of the tree on a GPU
    # machine): whether that tree was dirty is then unknown
    given = os.environ.get("BOLE_COMMIT")
    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "cpu": cpu_model(),
        "cpu_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "triton": triton_version,
        "fla": fla_version,
        "python": platform.python_version(),
        "commit": given or commit or None,
        "dirty": None if given else bool(dirty),
    }


def add_speedups(rows: list[dict]) -> None:
    """Sets `speedup_over_ar` and `speedup_over_ar_static` of every row whose (dataset, batch size) also ran that
    baseline (issue 8 reports both of transformers' configurations)."""
    for baseline in ("ar", "ar-static"):
        base = {(r["dataset"], r["batch_size"]): r["output_tokens_per_s"] for r in rows if r["mode"] == baseline}
        for r in rows:
            b, tokens_per_s = base.get((r["dataset"], r["batch_size"])), r["output_tokens_per_s"]
            speedup = tokens_per_s / b if b and tokens_per_s is not None else None
            r[f"speedup_over_{baseline.replace('-', '_')}"] = speedup


def write_jsonl(rows: list[dict], header: dict, path: Path) -> None:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps({**header, **r}) + "\n")


def _fmt(x, spec: str = ".1f") -> str:
    return "–" if x is None else format(x, spec)


CPU_NOTE = (
    "**On a CPU the timings are no result.** hf_bole is built for GPUs, and a CPU run's timings move with the "
    "machine's load (on a shared 2-core machine the same command's tokens/s moved by 2x and more from run to run), so "
    "the table gives no speed-up and no comparison of budgets. Read `accepted/round` (tokens per forward of the "
    "model; plain `generate` makes one a forward) and `exact` (outputs equal to plain greedy, token for token)."
)
HOUSE_QUALITY_NOTE = (
    "The house model (15M parameters, trained for minutes: eval/house/) measures acceptance; it solves no MBPP or "
    "GSM8K task, so `quality` is 0 for plain `generate` too and says nothing about hf_bole."
)


def markdown(rows: list[dict], header: dict) -> str:
    """The results table, its settings stated above it (STYLE.md §6). On a CPU it leaves out the speed-ups."""
    m, s = header["machine"], header["settings"]
    where = m["gpu"] or f"CPU ({m['cpu_threads']} threads)"
    devices = header.get("devices") or []
    on_cpu = not any(d.startswith("cuda") for d in devices) if devices else m["gpu"] is None
    speedup = not on_cpu  # a column of tokens/s over ar's
    static = speedup and any(r.get("speedup_over_ar_static") is not None for r in rows)  # where ar-static ran
    parallel = s.get("num_processes", 1) > 1  # data-parallel: a column of the processes' throughput together
    graphs = "on" if s.get("cuda_graphs") else "off"
    if graphs == "on" and on_cpu:  # asked for, but a CPU has none: every kernel launches from Python
        graphs = "off (a CPU has none)"
    if graphs == "on" and len(devices) > 1:  # generate turns them off for a model spread by --device-map, and says so
        graphs = f"off (the model spans {', '.join(devices)})"
    tp = s.get("tensor_parallel", 1)
    if tp > 1:  # and for a tensor-parallel one (--tp)
        where = f"{where} ×{tp}, the model sharded over {tp} processes (tensor parallelism, --tp)"
        graphs = "off (tensor parallelism)"
    attention = {  # results written before the header settled "auto" say neither
        "triton": ", tree attention by hf_bole's kernel (bole_attention=\"triton\")",
        "model": ", tree attention by the model's own attention with the tree mask (bole_attention=\"model\")",
    }.get(s.get("attention"), "")
    lines = [
        f"# Results: {s['model']}",
        "",
        f"{where}, torch {m['torch']}, transformers {m['transformers']}, triton {m['triton']}, commit "
        f"`{(m['commit'] or '?')[:9]}`{' (dirty)' if m['dirty'] else ''}"
        f"{', fla-core ' + m['fla'] if m.get('fla') else ''}. {s['dtype']}, temperature {s['temperature']}, "
        f"max {s['max_new_tokens']} new tokens, drafter `{s['drafter']}`, tree depth {_one(s['depth'])} topk {s['topk']} "
        f"budget {_one(s['budget'])} epsilon {_one(s['epsilon'])} (chain: depth {_one(s.get('chain_depth', [CHAIN_DEPTH]))}, "
        f"topk 1), SDPA cuDNN "
        f"{'on' if s.get('cudnn_sdpa') else 'off'} for every mode, hf_bole's CUDA graphs {graphs}"
        f"{_compiled(s.get('compile'))}{attention}"
        f"{', the MTP drafter eager (--no-compile-drafter)' if s.get('compile_drafter') is False else ''}. "
        f"Tokens/s per process: generated tokens up to and including "
        f"EOS/stop over the wall time of the generate calls, prefill included; each batch timed "
        f"{s.get('repeats') or 1}× after an untimed warm-up, the median pass kept"
        + (", the modes' passes taken in turns (--interleave)." if s.get("interleave") else ".")
        + (f" Prompts/s: all {s.get('num_processes')} processes together, over the busiest one's generate time." * parallel)
        + f" Command: `{s['command']}`",
        "",
        *[CPU_NOTE, ""] * on_cpu,
        "| dataset | mode | batch | prompts | tokens/s |" + " speedup |" * speedup + " ÷ ar-static |" * static
        + " prompts/s |" * parallel + " TTFT ms | TPOT ms | accepted/round | exact | quality | peak GiB | tree state MiB |",
        "|---|---|---:|---:|---:|" + "---:|" * (speedup + static + parallel) + "---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        quality = ", ".join(f"{k} {v:.3g}" for k, v in (r["quality"] or {}).items()) or "–"
        peak = r["peak_memory_bytes"] / 2**30 if r["peak_memory_bytes"] is not None else None
        tree = sum(r["transient_bytes"].values()) / 2**20 if r["transient_bytes"] else None
        exact = f"{100 * r['exact_share']:.0f}%" if r["exact_share"] is not None else "–"
        tokens_per_s = r.get("error") or _fmt(r["output_tokens_per_s"])  # a mode that ran out of memory says so
        cells = [
            r["dataset"], r["mode"], r["batch_size"], r["num_prompts"], tokens_per_s,
            *[_fmt(r["speedup_over_ar"], ".2f")] * speedup, *[_fmt(r.get("speedup_over_ar_static"), ".2f")] * static,
            *[_fmt(r.get("prompts_per_s"), ".2f")] * parallel,
            _fmt(r["ttft_ms"]), _fmt(r["tpot_ms"]),
            _fmt(r["mean_accepted_tokens"], ".2f"), exact, quality, _fmt(peak, ".2f"), _fmt(tree, ".2f"),
        ]  # fmt: skip
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    if any(r["quality"] for r in rows):
        lines += ["", "`quality` scores every mode's decoded text alike: a greedy mode whose outputs all equal ar's "
                  "(`exact` 100%) scores what ar scores." + (" " + HOUSE_QUALITY_NOTE) * is_house(s["model"])]
    lines += _phase_table(rows, "round_phase_ms", "Where a round's time goes (ms per round; CUDA: device timeline, idle "
                          "gaps included):")
    lines += _phase_table(rows, "round_host_phase_ms", "The same phases on the host clock (ms per round in their Python "
                          "code; where the host's total exceeds the device's, the GPU waited for Python):")
    lines += budget_sweep(rows) if not on_cpu else []  # a comparison of timings too
    diverged = [(r, d) for r in rows for d in r["divergences"]]
    if diverged:
        lines += ["", "Greedy outputs that differ from `ar` (first divergence, plain-forward logits there):", ""]
        for r, d in diverged:
            lines.append(
                f"- {r['dataset']} / {r['mode']} / batch {r['batch_size']} / prompt {d['prompt_id']}: token "
                f"{d['position']}, ar {d['reference_token']} vs {d['output_token']}: {d['explanation']}"
            )
    return "\n".join(lines) + "\n"


def is_house(model: str) -> bool:
    """Whether `model` names the house checkpoint (eval/house/checkpoint of any clone)."""
    return Path(model).parts[-3:] == ("eval", "house", "checkpoint")


def _phase_table(rows: list[dict], key: str, title: str) -> list[str]:
    """Markdown lines of the per-round phase times `key` of the rows that have them (none: no lines)."""
    profiled = [r for r in rows if r.get(key)]
    if not profiled:
        return []
    phases = list(profiled[0][key])
    lines = ["", title, "", "| dataset | mode | batch | " + " | ".join(phases) + " | total |",
             "|---|---|---:|" + "---:|" * (len(phases) + 1)]  # fmt: skip
    for r in profiled:
        ms = r[key]
        cells = " | ".join(f"{ms[p]:.2f}" for p in phases)
        lines.append(f"| {r['dataset']} | {r['mode']} | {r['batch_size']} | {cells} | {sum(ms.values()):.2f} |")
    return lines


def plots(rows: list[dict], out_dir: Path, comparisons: bool = True) -> list[Path]:
    """Throughput vs batch size per mode, accepted-length histograms, and unless `comparisons` is False (a CPU
    run's) the speedup over `ar` per dataset and, where fixed budgets were swept, each batch size's throughput
    against its best fixed budget (dashed: auto)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    written = []

    fig, axes = plt.subplots(1, len(datasets), figsize=(4.5 * len(datasets), 3.5), squeeze=False)
    for ax, ds in zip(axes[0], datasets):
        for mode in modes:
            pts = sorted(
                (r["batch_size"], r["output_tokens_per_s"])
                for r in rows
                if r["dataset"] == ds and r["mode"] == mode and r["output_tokens_per_s"] is not None
            )
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
        ax.set(
            title=ds,
            xlabel="batch size",
            ylabel="output tokens/s",
            xscale="log",
            xticks=sorted({r["batch_size"] for r in rows}),
        )
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.legend()
    written.append(_save(fig, out_dir / "throughput_vs_batch.png"))

    drafting = [m for m in modes if m not in ("ar", "ar-static")]
    if drafting:
        fig, axes = plt.subplots(1, len(drafting), figsize=(4.5 * len(drafting), 3.5), squeeze=False)
        for ax, mode in zip(axes[0], drafting):
            width = 0.8 / len(datasets)
            for k, ds in enumerate(datasets):
                hist: dict[int, int] = {}
                for r in rows:
                    if r["dataset"] == ds and r["mode"] == mode:
                        for n, c in r["accept_histogram"].items():
                            hist[int(n)] = hist.get(int(n), 0) + c
                total = sum(hist.values()) or 1
                xs = sorted(hist)
                ax.bar([x + k * width for x in xs], [hist[x] / total for x in xs], width=width, label=ds)
            ax.set(title=mode, xlabel="tokens per verify round (bonus included)", ylabel="share of rounds")
            ax.legend()
        written.append(_save(fig, out_dir / "accept_histogram.png"))

    with_speedup = [r for r in rows if comparisons and r["mode"] != "ar" and r["speedup_over_ar"] is not None]
    if with_speedup:
        series = list(dict.fromkeys((r["mode"], r["batch_size"]) for r in with_speedup))
        fig, ax = plt.subplots(figsize=(max(5, 1.5 * len(datasets) * len(series) / 2), 3.5))
        width = 0.8 / len(series)
        for k, (mode, bs) in enumerate(series):
            ys = [
                next(
                    (
                        r["speedup_over_ar"]
                        for r in with_speedup
                        if (r["dataset"], r["mode"], r["batch_size"]) == (ds, mode, bs)
                    ),
                    0,
                )
                for ds in datasets
            ]
            ax.bar([i + k * width for i in range(len(datasets))], ys, width=width, label=f"{mode}, batch {bs}")
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(datasets))], datasets)
        ax.set(ylabel="speedup over ar (tokens/s)")
        ax.legend(fontsize="small")
        written.append(_save(fig, out_dir / "speedup.png"))

    swept = budget_cells(rows) if comparisons else {}
    if swept:  # a budget sweep (issue 5): each batch size's tokens/s over its best fixed budget, auto beside them
        panels = list(dict.fromkeys(key[:3] for key in swept))  # (dataset, mode, depth)
        fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.8), squeeze=False)
        for ax, panel in zip(axes[0], panels):
            ticks: set[int] = set()  # the fixed budgets this panel ran
            for (*key, batch), tps in swept.items():
                if tuple(key) != panel:
                    continue
                fixed = sorted((b, t) for b, t in tps.items() if isinstance(b, int))
                ticks.update(b for b, _ in fixed)
                best = max(t for _, t in fixed)
                xs, ys = [b for b, _ in fixed], [t / best for _, t in fixed]
                (line,) = ax.plot(xs, ys, marker="o", label=f"batch {batch}")
                for label, t in tps.items():  # auto and goodput: one budget per round, not a point on the x axis
                    if not isinstance(label, int):
                        ax.axhline(t / best, color=line.get_color(), linestyle="--", linewidth=1,
                                   label=f"batch {batch}, {label}: {t / best:.2f}")
            ax.axhline(0.95, color="gray", linewidth=0.8, linestyle=":")  # issue 5: auto within 5% of the best
            ax.set(title=f"{panel[0]}, {panel[1]}, depth {panel[2]}", xlabel="fixed budget (nodes a round)",
                   ylabel="tokens/s ÷ best fixed budget")
            ax.set_xscale("log", base=2)
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            ax.set_xticks(sorted(ticks))
            ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.legend(fontsize="x-small")
        written.append(_save(fig, out_dir / "budget_sweep.png"))
    return written


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def budget_cells(rows: list[dict]) -> dict[tuple, dict]:
    """`{(dataset, mode, depth, batch): {budget label: tokens/s}}` of the hf_bole tree modes' rows, for the
    (dataset, mode, depth, batch) cells that ran at least two fixed budgets (`--budget 16 32 64 auto`): a fixed
    budget's label is its node count, "auto"'s and "goodput"'s name their epsilon."""
    cells: dict[tuple, dict] = {}
    for r in rows:
        mode = r["mode"].split()[0]
        if mode in ("tree-serial", "bole") and r["output_tokens_per_s"]:
            mode += " compiled" * bool(r.get("compiled"))  # a --compile off on sweep compares budgets per form
            budget = r["tree_budget"] if r["tree_budget"] != "auto" else f"auto ε={r['tree_epsilon']}"
            budget = budget if budget != "goodput" else f"goodput (ε={r['tree_epsilon']} first)"
            cells.setdefault((r["dataset"], mode, r["tree_depth"], r["batch_size"]), {})[budget] = r["output_tokens_per_s"]
    return {k: v for k, v in cells.items() if sum(isinstance(b, int) for b in v) >= 2}


def budget_sweep(rows: list[dict]) -> list[str]:
    """Markdown lines comparing budgets (issue 5): per (dataset, mode, depth, batch size) with at least two fixed
    budgets, the best fixed one against each `auto` and `goodput` row; then each fixed budget's largest shortfall from
    the best over the batch sizes. Nothing unless the run swept fixed budgets (`--budget 16 32 64 auto`)."""
    swept = budget_cells(rows)
    if not swept:
        return []
    lines = ["", "Budgets (tokens/s; the best fixed budget of each batch size against auto):", "",
             "| dataset | mode | depth | batch | best fixed | tokens/s | auto | tokens/s | auto / best |",
             "|---|---|---:|---:|---:|---:|---|---:|---:|"]  # fmt: skip
    shortfall: dict[tuple, dict] = {}  # (dataset, mode, depth) -> {fixed budget: (worst ratio, its batch)}
    for (ds, mode, depth, batch), tps in swept.items():
        fixed = {b: t for b, t in tps.items() if isinstance(b, int)}
        best = max(fixed, key=fixed.get)
        autos = [(b, t) for b, t in tps.items() if not isinstance(b, int)] or [("–", None)]
        for label, t in autos:
            ratio = f"{t / fixed[best]:.2f}" if t else "–"
            lines.append(f"| {ds} | {mode} | {depth} | {batch} | {best} | {fixed[best]:.1f} | {label} | {_fmt(t)} | {ratio} |")
        worst = shortfall.setdefault((ds, mode, depth), {})
        for b, t in fixed.items():
            if b not in worst or t / fixed[best] < worst[b][0]:
                worst[b] = (t / fixed[best], batch)
    lines += ["", "Each fixed budget's largest shortfall from the best fixed budget over the batch sizes:", ""]
    for (ds, mode, depth), worst in shortfall.items():
        parts = ", ".join(f"{b}: {100 * (1 - w):.0f}% at batch {bs}" for b, (w, bs) in sorted(worst.items()))
        lines.append(f"- {ds} / {mode} / depth {depth}: {parts}")
    return lines


def _one(values: list) -> str:
    """A setting given once, or the values a sweep ran (each row's mode names its own)."""
    return str(values[0]) if len(values) == 1 else "swept over " + "/".join(map(str, values))


def _compiled(compile: bool | list[bool] | None) -> str:
    """What the header says of `--compile`: a bool in older results, the swept values since."""
    values = compile if isinstance(compile, list) else [bool(compile)]
    if len(values) > 1:
        return ", hf_bole modes run with and without compiling their verify forward (rows marked 'compiled')"
    return ", its verify forward compiled" if values[0] else ""
