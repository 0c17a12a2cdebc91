"""Per round of the profiled call: kernels and GPU time per phase, the verify's kernels by kind, and the GPU's idle share.

    python results/speed_h200/thirteenth_session/kernel_log_summary.py results/speed_h200/thirteenth_session/call1/kernels_bole.tsv.gz
"""

import collections
import csv
import gzip
import sys


def kind(name: str) -> str:
    if name.startswith("nvjet") or "gemm" in name or "splitKreduce" in name:
        return "GEMM (cuBLAS)"
    if name.startswith("tree_"):
        return "hf_bole kernels"
    if "fmha" in name:
        return "attention (SDPA)"
    if name.startswith("triton"):
        return "inductor's fused kernels"
    if "direct_copy" in name:
        return "aten copies"
    return "other aten / memcpy"


rows = list(csv.DictReader(gzip.open(sys.argv[1], "rt"), delimiter="\t"))
runs, run = [], []  # consecutive kernels of one phase
for r in rows:
    if run and r["phase"] != run[-1]["phase"]:
        runs.append(run)
        run = []
    run.append(r)
runs.append(run)
rounds = [i for i, run in enumerate(runs) if run[0]["phase"] == "select"]
print(f"{len(rounds)} rounds")
per_phase = collections.defaultdict(lambda: [0, 0.0])
for i in rounds:
    for run in runs[i : i + 6]:
        per_phase[run[0]["phase"]][0] += len(run)
        per_phase[run[0]["phase"]][1] += sum(float(r["dur_us"]) for r in run)
print("| phase | kernels a round | GPU ms a round |\n|---|---:|---:|")
for phase, (n, us) in per_phase.items():
    print(f"| {phase} | {n / len(rounds):.0f} | {us / len(rounds) / 1e3:.3f} |")
verify = [r for run in runs if run[0]["phase"] == "verify" for r in run[2:]]  # the two input copies before the replay
kinds = collections.defaultdict(lambda: [0, 0.0])
for r in verify:
    kinds[kind(r["name"])][0] += 1
    kinds[kind(r["name"])][1] += float(r["dur_us"])
n = sum(1 for i in rounds)
print("\n| verify kernels | a round | GPU ms a round |\n|---|---:|---:|")
for k, (c, us) in sorted(kinds.items(), key=lambda kv: -kv[1][1]):
    print(f"| {k} | {c / n:.0f} | {us / n / 1e3:.3f} |")
starts = [float(runs[i][0]["start_us"]) for i in rounds]
busy = [sum(float(r["dur_us"]) for r in rows if a <= float(r["start_us"]) < b) for a, b in zip(starts, starts[1:])]
periods = [b - a for a, b in zip(starts, starts[1:])]
print(f"\nround period {sum(periods) / len(periods) / 1e3:.2f} ms, GPU busy {sum(busy) / len(busy) / 1e3:.2f} ms "
      f"(under the profiler, which slows the host)")
