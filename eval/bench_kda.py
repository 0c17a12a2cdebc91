"""One Kimi Delta Attention layer's tree verification on the GPU, side by side in one run (issue 59):

  bole       `tree_kda_verify` (hf_bole/kernels/tree_kda): the closed form's solve and apply kernels
  commit     `tree_kda_commit` of one accepted path as deep as the tree (timed alone, for the round's total)
  fla-chunk  fla-core's `chunk_kda` over a chain of the same number of tokens (prefill's kernel); skipped without fla
  serial     `tree_kda_verify_serial`: the node-by-node walk that writes every node's K x V state

at the KDA layer sizes of Kimi-Linear-48B-A3B (transformers' `KimiLinearConfig` defaults: 32 heads, head dims 128),
random bf16 q/k/v, fp32 gates and state, T = 64 and 128 tree nodes, B = 1 and 16, random trees of depth <= 8 and
<= 16. Correctness comes first: the kernels are compared with the float64 closed form (fp32 and bf16 inputs, extreme
decays included) and nothing is timed if they stray. Each provider is timed as CUDA-graph replays over rotating
input sets (so neither launch overhead nor a warm L2 flatters it), median of many; transient memory is the peak
allocation of one eager call above what its inputs hold (its outputs included). Writes JSON lines, prints a markdown
table last.

    python eval/bench_kda.py --out benchmarks/kda.jsonl         # on a GPU
    python eval/bench_kda.py --cpu-smoke --out /tmp/kda.jsonl   # tiny sizes on the CPU (Triton interpreter)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

if "--cpu-smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported: the kernels run on the CPU

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hf_bole.kernels import tree_kda_commit, tree_kda_verify  # noqa: E402
from hf_bole.kernels.tree_kda import tree_kda_verify_serial  # noqa: E402
from hf_bole.kernels.tree_kda.closed_form import torch_tree_kda_verify  # noqa: E402
from hf_bole.kernels.tree_kda import closed_form_kernels  # noqa: E402
from eval.bench_kernels import machine_header, rel_err  # noqa: E402
from tests.kernels.trees import chain, random_tree  # noqa: E402

L2_BYTES = 60 * 2**20
PROVIDERS = ("bole", "commit", "fla-chunk", "serial")


def kimi_linear_kda_sizes() -> tuple[int, int, int]:
    """(heads, K, V) of a Kimi-Linear KDA layer: transformers' config defaults, which are Kimi-Linear-48B-A3B's
    `linear_attn_config` (num_heads 32, head_dim 128 for q, k and v)."""
    from transformers import KimiLinearConfig

    config = KimiLinearConfig()
    return config.linear_num_heads, config.linear_head_dim, config.linear_head_dim


def tree_parents(B: int, T: int, depth: int, seed: int, device: str) -> torch.Tensor:
    """Random trees of depth <= `depth` (a chain where depth >= T - 1)."""
    gen = torch.Generator().manual_seed(seed)
    rows = [chain(T) if depth >= T - 1 else random_tree(T, max_depth=depth, branching=0.5, gen=gen) for _ in range(B)]
    return torch.tensor(rows, dtype=torch.int64, device=device)


def layer_inputs(B, T, H, K, V, seed, device, dtype=torch.bfloat16, extreme=False):
    """q, k, v, g, beta, h0 like a Kimi-Linear KDA layer's: raw q/k (normalised in the kernel), g = -exp(A_log)
    softplus(x) per key channel (fp32, as transformers computes it), beta in (0, 1), an fp32 state. `extreme`: a third
    of the decays strong (g in [-1000, -10]) and a third weak (g in [-1e-3, 0])."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(B, T, H, K, device=device, generator=gen).to(dtype)
    k = torch.randn(B, T, H, K, device=device, generator=gen).to(dtype)
    v = torch.randn(B, T, H, V, device=device, generator=gen).to(dtype)
    a = torch.empty(1, 1, H, 1, device=device).uniform_(1, 16, generator=gen)
    g = -a * torch.nn.functional.softplus(torch.randn(B, T, H, K, device=device, generator=gen) - 3.0)
    if extreme:
        pick = torch.rand(B, T, H, K, device=device, generator=gen)
        strong = -torch.empty(B, T, H, K, device=device).uniform_(10, 1000, generator=gen)
        weak = -torch.empty(B, T, H, K, device=device).uniform_(0, 1e-3, generator=gen)
        g = torch.where(pick < 1 / 3, strong, torch.where(pick < 2 / 3, weak, g))
    beta = torch.rand(B, T, H, device=device, generator=gen).to(dtype)
    h0 = torch.randn(B, H, K, V, device=device, generator=gen) * 0.5
    return q, k, v, g, beta, h0


def rotating_inputs(B, T, H, K, V, device, cpu_smoke) -> list[tuple]:
    """Enough `layer_inputs` sets (2 to 16) to span 3x the L2 cache, so that timed calls read from memory."""
    set_bytes = B * H * K * V * 4 + B * T * H * (2 * K * 2 + V * 2 + K * 4 + 2)
    n_sets = 2 if cpu_smoke else max(2, min(16, -(-3 * L2_BYTES // set_bytes)))
    return [layer_inputs(B, T, H, K, V, seed=s, device=device) for s in range(n_sets)]


def deepest_path(parents: torch.Tensor, device: str) -> torch.Tensor:
    """`[B, L]`: every request's root-to-leaf path to its deepest node (the first one), right-padded with -1."""
    paths = []
    for row in parents.tolist():
        depths = []
        for p in row:
            depths.append(0 if p < 0 else depths[p] + 1)
        node, path = max(range(len(row)), key=depths.__getitem__), []
        while node >= 0:
            path.append(node)
            node = row[node]
        paths.append(path[::-1])
    L = max(map(len, paths))
    return torch.tensor([p + [-1] * (L - len(p)) for p in paths], device=device)


def check_correctness(H, K, V, device) -> dict:
    """Relative error of o and u (and of the committed state) of the kernels against the float64 closed form, at
    the layer's sizes with two requests: fp32 and bf16 inputs, ordinary and extreme decays, a depth-16 tree, a bushy
    one and a chain of 40; the serial walk's o and states beside them."""
    errs = {}
    T = 128 if device == "cuda" else 20
    cases = [(torch.float32, False, T, 16), (torch.float32, True, T, 16), (torch.bfloat16, True, T, 16),
             (torch.float32, True, T, 3), (torch.float32, True, 40, 39)]  # fmt: skip
    for dtype, extreme, n, depth in cases:
        q, k, v, g, beta, h0 = layer_inputs(2, n, H, K, V, seed=depth, device=device, dtype=dtype, extreme=extreme)
        parents = tree_parents(2, n, depth, seed=depth, device=device)
        ref_o, ref_u = torch_tree_kda_verify(*(x.double() for x in (q, k, v, g, beta)), parents, h0.double(), K**-0.5, True)
        o, u = tree_kda_verify(q, k, v, g, beta, parents, h0, use_qk_l2norm_in_kernel=True)
        key = f"{str(dtype)[6:]}_{'extreme' if extreme else 'kimi'}_T{n}_d{depth}"
        errs[f"bole_{key}_o"], errs[f"bole_{key}_u"] = rel_err(o, ref_o), rel_err(u, ref_u)
        o_s, states = tree_kda_verify_serial(q, k, v, g, beta, parents, h0, use_qk_l2norm_in_kernel=True)
        errs[f"serial_{key}_o"] = rel_err(o_s, ref_o)
        path = deepest_path(parents, device)
        new = tree_kda_commit(h0, k, g, u, path, use_qk_l2norm_in_kernel=True)
        leaf = path.max(dim=1).values
        errs[f"commit_{key}"] = rel_err(new, states[torch.arange(2, device=device), leaf])
    return errs


def fla_chunk_kda():
    try:
        from fla.ops.kda import chunk_kda
    except ImportError:
        return None
    return chunk_kda


def check_fla(H, K, V, device) -> dict:
    """fla's chunked KDA on a chain against the float64 closed form (reported, not a gate: its error is its own)."""
    chunk_kda = fla_chunk_kda()
    if chunk_kda is None or device != "cuda":
        return {}
    q, k, v, g, beta, h0 = layer_inputs(2, 128, H, K, V, seed=3, device=device)
    parents = tree_parents(2, 128, 127, seed=0, device=device)
    ref_o, _ = torch_tree_kda_verify(*(x.double() for x in (q, k, v, g, beta)), parents, h0.double(), K**-0.5, True)
    o, _ = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    return {"fla_chunk_chain_o": rel_err(o, ref_o)}


def time_calls(fn, sets: list, device: str, reps: int = 30) -> tuple[float, float, float, bool | None]:
    """Median (and 20/80% quantiles) of one call in ms, and whether a CUDA graph ran it (None on the CPU). On the GPU
    a graph holds one call per input set, so consecutive calls read different memory, and each replay is timed with
    events; where capture fails (a provider that synchronises) the calls are timed eagerly the same way. On the CPU:
    wall time."""
    for s in sets[:2]:
        fn(*s)  # autotune and compile outside the timed region
    if device != "cuda":
        times = []
        for _ in range(3):
            start = time.perf_counter()
            for s in sets:
                fn(*s)
            times.append((time.perf_counter() - start) * 1e3 / len(sets))
        return statistics.median(times), min(times), max(times), None
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for s in sets:
                fn(*s)
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            for s in sets:
                fn(*s)
        run, graphed = graph.replay, True
    except RuntimeError:
        torch.cuda.synchronize()

        def run():
            for s in sets:
                fn(*s)

        graphed = False
    for _ in range(3):
        run()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(sets))
    q = statistics.quantiles(times, n=10)
    return statistics.median(times), q[1], q[7], graphed


def transient_bytes(fn, inputs: tuple, device: str) -> int | None:
    """Peak allocation of one eager call above what was allocated before it (outputs and workspaces)."""
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn(*inputs)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del out
    return peak


def chosen_configs() -> dict:
    """The launch configs tree_kda_verify's autotuners chose at the shape they ran last."""
    tuners = {"solve": closed_form_kernels.tree_kda_verify_solve_kernel,
              "apply": closed_form_kernels.tree_kda_verify_apply_kernel.fn}  # fmt: skip
    return {name: f"{tuner.best_config.kwargs},w={tuner.best_config.num_warps}" for name, tuner in tuners.items()}


def bench_shape(B, T, H, K, V, depth, providers, precision, device, cpu_smoke) -> list[dict]:
    parents = tree_parents(B, T, depth, seed=T + depth, device=device)
    path = deepest_path(parents, device)  # every request accepts the path to its deepest node
    sets = rotating_inputs(B, T, H, K, V, device, cpu_smoke)
    # the commit's factors ride with each input set
    sets = [s + (tree_kda_verify(*s[:5], parents, s[5], use_qk_l2norm_in_kernel=True)[1],) for s in sets]
    rows = []
    for name in providers:
        if name == "bole":

            def fn(q, k, v, g, b, h, u):
                return tree_kda_verify(q, k, v, g, b, parents, h, use_qk_l2norm_in_kernel=True, dot_precision=precision)

        elif name == "commit":

            def fn(q, k, v, g, b, h, u):
                return tree_kda_commit(h, k, g, u, path, use_qk_l2norm_in_kernel=True, check_values=False)

        elif name == "serial":

            def fn(q, k, v, g, b, h, u):
                return tree_kda_verify_serial(q, k, v, g, b, parents, h, use_qk_l2norm_in_kernel=True)

        elif name == "fla-chunk":
            chunk_kda = fla_chunk_kda()
            if chunk_kda is None or device != "cuda":
                continue

            def fn(q, k, v, g, b, h, u):
                return chunk_kda(q, k, v, g, b, initial_state=h, output_final_state=True, use_qk_l2norm_in_kernel=True)

        try:
            ms, lo, hi, graphed = time_calls(fn, sets, device)
            transient = transient_bytes(fn, sets[0], device)
        except torch.OutOfMemoryError:
            rows.append({"provider": name, "oom": True})
            torch.cuda.empty_cache()
            continue
        rows.append(
            {"provider": name, "ms": ms, "ms_q20": lo, "ms_q80": hi, "cuda_graph": graphed, "transient_bytes": transient}
            | ({"configs": chosen_configs()} if name == "bole" and device == "cuda" else {})
        )
    del sets
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON lines: a header line, then one line per (shape, provider)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU under the Triton interpreter")
    ap.add_argument("--precision", default="tf32x3", help="dot_precision of tree_kda_verify")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--nodes", type=int, nargs="+", default=[64, 128], help="tree nodes T per request")
    ap.add_argument("--depths", type=int, nargs="+", default=[8, 16], help="the trees' largest depth")
    ap.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    args = ap.parse_args()

    device = "cpu" if args.cpu_smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no GPU: run with --cpu-smoke to check the script on the CPU")
    H, K, V = kimi_linear_kda_sizes()
    if args.cpu_smoke:
        H, K, V = 2, 16, 16
        args.batches, args.nodes, args.depths = [1, 2], [9, 20], [4]
    header = machine_header(device)
    errs = check_correctness(H, K, V, device) | check_fla(H, K, V, device)
    print(json.dumps({"header": header, "errors": errs}, indent=1), flush=True)
    gates = {key: (1e-2 if "bfloat16" in key and key.endswith("_o") else 1e-5) for key in errs if not key.startswith("fla")}
    failing = sorted(key for key, bound in gates.items() if not errs[key] <= bound)
    if failing:
        raise SystemExit(f"not timed: {failing} stray from float64 beyond their bounds (1e-5 fp32, 1e-2 bf16 o)")

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    table = []
    with open(args.out, "w") as f:
        f.write(json.dumps({"header": header, "errors": errs, "H": H, "K": K, "V": V, "precision": args.precision}) + "\n")
        for depth in args.depths:
            for T in args.nodes:
                for B in args.batches:
                    rows = bench_shape(B, T, H, K, V, depth, args.providers, args.precision, device, args.cpu_smoke)
                    for r in rows:
                        r.update({"B": B, "T": T, "H": H, "K": K, "V": V, "depth": depth})
                        f.write(json.dumps(r) + "\n")
                    table.append((B, T, depth, {r["provider"]: r for r in rows}))
                    print(B, T, depth, {r["provider"]: round(r.get("ms", float("nan")), 4) for r in rows}, flush=True)

    def ms(r, p):
        return r.get(p, {}).get("ms", float("nan"))

    def mib(r, p):
        x = r.get(p, {}).get("transient_bytes")
        return float("nan") if x is None else x / 2**20

    print(f"\n{header['gpu']}, torch {header['torch']}, triton {header['triton']}, fla {header['fla']}, "
          f"commit {header['commit']}")  # fmt: skip
    sizes = "tiny (--cpu-smoke)" if args.cpu_smoke else "Kimi-Linear-48B-A3B's"
    eager = sorted({f"{p} B={B} T={T} d={d}" for B, T, d, r in table for p, x in r.items() if x.get("cuda_graph") is False})
    timing = "CPU wall time" if args.cpu_smoke else "median of CUDA-graph replays"
    print(f"KDA layer, {sizes}: H = {H}, K = V = {K}; bf16 q/k/v, fp32 g and state; dot {args.precision}; ms per layer "
          f"({timing}{'; timed eagerly: ' + ', '.join(eager) if eager else ''}); fla-chunk runs a "
          f"chain of T tokens; MiB: transient memory of one call, outputs included (bole's workspace: "
          f"{closed_form_kernels.workspace_bytes(1, 128, H, K) / 2**20:.1f} MiB per request at T = 128)\n")  # fmt: skip
    columns = "B | T | depth | bole | commit | fla-chunk | serial | bole / fla | serial / bole | bole MiB | fla MiB | serial MiB"
    print(f"| {columns} |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for B, T, depth, r in table:
        bo, co, fl, se = (ms(r, p) for p in ("bole", "commit", "fla-chunk", "serial"))
        print(f"| {B} | {T} | {depth} | {bo:.4f} | {co:.4f} | {fl:.4f} | {se:.4f} | {bo / fl:.2f} | {se / bo:.1f} | "
              f"{mib(r, 'bole'):.1f} | {mib(r, 'fla-chunk'):.1f} | {mib(r, 'serial'):.1f} |")  # fmt: skip


if __name__ == "__main__":
    with torch.no_grad():
        main()
