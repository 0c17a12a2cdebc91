"""Where a decoding call's time goes, from torch's profiler: GPU busy time against wall time, and the top ops.

    python eval/profile_round.py --modes ar bole --batch-sizes 1 --max-new-tokens 64          # house model
    python eval/profile_round.py --shape 9B --modes ar bole --depth 6 --json p.json             # random 9B, oracle

Takes eval/run.py's arguments (model, shape, modes, tree settings; the first batch size and dataset are used). Each
mode runs `hf_bole.warmup` and its first batch twice untimed, then once under the profiler. Per mode it prints wall
time, the summed time of GPU kernels (one stream: their sum is the busy time), the host's share (1 - busy / wall:
time the GPU waits for Python, launches and synchronisations) and the ops that cost most on the host and on the GPU;
for hf_bole's modes also, per round and phase (draft, select, verify, ...), the host time spent in the phase's code,
the time of the GPU kernels that ran inside the phase (CUDA graph replays included) and the phase's span on the GPU
timeline. A span far above its kernels with host time above it is a host-bound phase: the GPU waited for Python.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hf_bole  # noqa: E402
from eval import run  # noqa: E402
from eval.modes import make_modes  # noqa: E402
from hf_bole.generation.phases import PHASES  # noqa: E402

CUDA = torch.autograd.DeviceType.CUDA


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace-dir", help="also write each mode's Chrome trace (gzipped JSON) here")
    ap.add_argument("--json", help="also write the summaries (the table, the top ops) to this file")
    ap.add_argument("--top", type=int, default=15, help="ops listed per table")
    ap.add_argument(
        "--kernel-log",
        help="also write every GPU kernel of each profiled call, in launch order, to this folder "
        "(kernels_MODE.tsv: start and duration in microseconds, the enclosing bole:: phase, the name)",
    )
    ours, rest = ap.parse_known_args(argv)
    args = run.parse_args(rest)
    args.profile = True  # hf_bole's phases become profiler ranges (bole::draft, ...): the per-phase table
    cuda = args.device == "cuda"  # on a CPU the tables still run (a check of the script), with no GPU time
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device(args.device)
    dtype = run.DTYPES[args.dtype] or (torch.bfloat16 if cuda else torch.float32)
    sync = torch.cuda.synchronize if cuda else lambda device: None
    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda
    run.set_backends(args)
    torch.manual_seed(args.seed)
    model, tokenizer, label = run.load_target(args, device, dtype)
    dataset, prompts = next(iter(run.load_prompt_sets(args, model, tokenizer).items()))
    generation = run.generation_kwargs(args, model, tokenizer)
    batch_size = args.batch_sizes[0]
    batch = list(range(min(batch_size, len(prompts))))

    summaries, reference = [], []
    for name in ["ar"] * ("ar" not in args.modes) + args.modes:
        for mode in make_modes(name, batch_size, args):
            if mode.drafts and cuda:  # every tree width's kernels, then the first calls' other costs
                hf_bole.warmup(model, len(batch), verify=mode.verify or "closed_form")
            for _ in range(2):
                record = run.run_batch(model, tokenizer, prompts, batch, mode, args, generation, reference[:1])
            if name == "ar":
                reference = [record]
                if "ar" not in args.modes:
                    continue
            sync(device)
            with profile(activities=activities) as prof:
                start = time.perf_counter()
                record = run.run_batch(model, tokenizer, prompts, batch, mode, args, generation, reference[:1])
                sync(device)
                wall = time.perf_counter() - start
            summaries.append(_summarize(prof, mode.label, record, wall, ours.top))
            if ours.trace_dir:
                Path(ours.trace_dir).mkdir(parents=True, exist_ok=True)
                prof.export_chrome_trace(str(Path(ours.trace_dir) / f"trace_{mode.label.replace(' ', '_')}.json.gz"))
            if ours.kernel_log:
                Path(ours.kernel_log).mkdir(parents=True, exist_ok=True)
                _write_kernel_log(prof, Path(ours.kernel_log) / f"kernels_{mode.label.replace(' ', '_')}.tsv")

    print(f"\n{label}, {dataset}, batch {batch_size}, {args.max_new_tokens} new tokens, {dtype}, "
          f"{torch.cuda.get_device_name(device) if cuda else device}")  # fmt: skip
    print("| mode | wall ms | GPU busy ms | host share | kernels | tokens | ms/token | mean accepted |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for s in summaries:
        print(
            f"| {s['mode']} | {s['wall_ms']:.1f} | {s['gpu_busy_ms']:.1f} | {s['host_share']:.0%} | {s['kernels']} "
            f"| {s['tokens']} | {s['ms_per_token']:.2f} | {s['mean_accepted'] or '-'} |"
        )
    phased = [s for s in summaries if s["phases"]]
    if phased:
        print("\nPer round and phase, ms: host time in the phase's code | its GPU kernels (graph replays included) | "
              "its span on the GPU timeline, idle gaps included. A phase whose host time exceeds its kernels' keeps "
              "the GPU waiting once the host falls behind.")  # fmt: skip
        print("| mode | " + " | ".join(PHASES) + " |")
        print("|---|" + "---:|" * len(PHASES))
        for s in phased:
            cells = (
                " \\| ".join(f"{s['phases'][p].get(k, 0.0):.2f}" for k in ("host_ms", "kernel_ms", "span_ms"))
                for p in PHASES
            )
            print(f"| {s['mode']} | " + " | ".join(cells) + " |")
    if ours.json:
        Path(ours.json).write_text(json.dumps({"model": label, "dataset": dataset, "batch_size": batch_size,
                                               "settings": vars(args), "modes": summaries}, indent=1, default=str))  # fmt: skip
    return summaries


def _summarize(prof, label: str, record: dict, wall: float, top: int) -> dict:
    events = prof.key_averages()
    self_device_time = lambda e: e.self_device_time_total  # noqa: E731
    kernels = [e for e in prof.events() if e.device_type == CUDA]
    busy_us = sum(e.time_range.elapsed_us() for e in kernels)
    tokens = max(len(t) for t in record["tokens"])
    accepts = record["accept_lengths"]
    print(f"\n=== {label}: {wall * 1e3:.1f} ms wall, {busy_us / 1e3:.1f} ms of GPU kernels ({len(kernels)} launches)")
    print(events.table(sort_by="self_cpu_time_total", row_limit=top))
    if kernels:
        print(events.table(sort_by="self_device_time_total", row_limit=top))
    rounds = (record["round_time_ms"] or {}).get("rounds", 0)
    phases = None
    if rounds:
        # A phase's range appears twice: on the host (the time in its code) and on the GPU timeline (from its first
        # kernel's start to its last's end, idle gaps included); the kernels inside the latter are its GPU work.
        host_us = _host_phase_us(events)
        ranges = _gpu_phase_ranges(prof)
        kernel_us, span_us = dict.fromkeys(PHASES, 0.0), dict.fromkeys(PHASES, 0.0)
        for _, duration, phase, _ in _kernels_by_phase(prof, ranges):
            if phase in kernel_us:
                kernel_us[phase] += duration
        for start, end, phase in ranges:
            if phase in span_us:
                span_us[phase] += end - start
        phases = {
            phase: {key: us[phase] / 1e3 / rounds for key, us in
                    (("host_ms", host_us), ("kernel_ms", kernel_us), ("span_ms", span_us)) if phase in us}
            for phase in PHASES
        }  # fmt: skip
    return {
        "mode": label,
        "phases": phases,
        "wall_ms": wall * 1e3,
        "gpu_busy_ms": busy_us / 1e3,
        "host_share": max(0.0, 1 - busy_us / 1e6 / wall),
        "kernels": len(kernels),
        "tokens": tokens,
        "ms_per_token": wall * 1e3 / tokens,
        "mean_accepted": round(sum(a for a in accepts if a) / max(1, sum(1 for a in accepts if a)), 2) if accepts else None,
        "top_host_ops": [(e.key, e.self_cpu_time_total / 1e3) for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]],
        "top_gpu_ops": [
            (e.key, self_device_time(e) / 1e3) for e in sorted(events, key=lambda e: -self_device_time(e))[:top]
        ],
    }


def _host_phase_us(events) -> dict[str, float]:
    """phase -> microseconds of host time in its code, from the profiler's averaged events: the host-side bole::
    ranges, not their namesakes on the GPU timeline (which carry no host time)."""
    return {
        e.key.removeprefix("bole::"): e.cpu_time_total
        for e in events
        if e.key.startswith("bole::") and e.device_type == torch.autograd.DeviceType.CPU
    }


def _gpu_phase_ranges(prof) -> list[tuple[float, float, str]]:
    """(start, end, phase) in microseconds of every bole:: range on the GPU timeline, in start order: the phases'
    record_function ranges appear there too, as annotations spanning their kernels."""
    return sorted(
        (e.time_range.start, e.time_range.end, e.name.removeprefix("bole::"))
        for e in prof.events()
        if e.device_type == CUDA and e.name.startswith("bole::")
    )


def _kernels_by_phase(prof, phases: list[tuple[float, float, str]]) -> list[tuple[float, float, str, str]]:
    """(start, duration, phase, name) in microseconds of every GPU kernel in start order, with the phase range of
    `phases` (`_gpu_phase_ranges`) it ran in ("-" outside them)."""
    kernels = sorted(
        (e for e in prof.events() if e.device_type == CUDA and not e.name.startswith("bole::")),
        key=lambda e: e.time_range.start,
    )
    out, i = [], 0
    for e in kernels:
        start = e.time_range.start
        while i < len(phases) and phases[i][1] < start:
            i += 1
        phase = phases[i][2] if i < len(phases) and phases[i][0] <= start else "-"
        out.append((start, e.time_range.elapsed_us(), phase, e.name))
    return out


def _write_kernel_log(prof, path: Path) -> None:
    """Every GPU kernel in start order, with the bole:: phase range (on the GPU timeline) it ran in: what one
    round's phases launch, kernel by kernel, e.g. how many small kernels a layer of the verify forward runs."""
    kernels = _kernels_by_phase(prof, _gpu_phase_ranges(prof))
    t0 = kernels[0][0] if kernels else 0
    with path.open("w") as f:
        f.write("start_us\tdur_us\tphase\tname\n")
        for start, duration, phase, name in kernels:
            f.write(f"{start - t0:.1f}\t{duration:.1f}\t{phase}\t{name[:120]}\n")


if __name__ == "__main__":
    main()
