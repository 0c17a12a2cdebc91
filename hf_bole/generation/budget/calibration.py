"""Calibration of the verification budget: the timings a table holds, measured on the GPU, and their plot.

`T_ver(N)` is the complete verify forward (`tree_forward`: every layer, the LM head over every node) of a batch of
draft trees holding `N` draft nodes in all, plus one root per request, from a cache prefilled to the KV-length
bucket, at the width `generate` gives it: selection caps every request at the CUDA-graph bucket that holds `N` split
evenly over the requests (`select.row_width`), and a forward launched from Python is cut to the widest request's
exact width. Forwards are timed as `generate` launches them: replayed from CUDA graphs (`bole_cuda_graphs`, the
default on CUDA for dense models) or launched from Python. All run with hf_bole's SDPA backends
(`hf_bole.models.attention_backends`). The trees are MTP/EAGLE-2-shaped (`topk` children of the `topk` best nodes per
level, random draft probabilities, confidence differing by request) and the batch-shared selection splits `N` across
requests as in the decoding loop.

`N = 0` is the roots alone (plain decoding's step, at width 1), `N = batch size` selection's floor (each request's
best root child, width 2), the least a round that drafts verifies; above it, by default, the most nodes each wider
width holds (`capacities`), where the forward's cost steps. `T_commit` is a round's commit (`BoleCache.commit` of a
one-token path, replayed or launched as the forwards): it reads and writes every row's GDN state, which at a large
batch costs as much as a good part of the forward, the same for any tree. The rule (`rule.py`) weighs rounds,
`T_ver(N) + T_commit`.

A bucket's sweep over `N` stops at the first size whose forward costs more than `max_ratio` times the floor's: no
epsilon below `max_ratio - 1` would choose it, and at a large batch the wide forwards are the slow ones (at batch
256, width 128 is 32,768 tokens and 16 GiB of logits on a 248k vocabulary). The prompt's prefill runs in forwards
of at most `PREFILL_TOKENS` tokens across the batch.
"""

from __future__ import annotations

import functools
import logging
import statistics
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from hf_bole.config import BoleConfig, resolve_attention
from hf_bole.generation.budget.rule import choose_budget, entry_budget
from hf_bole.generation.budget.tables import BudgetEntry, BudgetTable, TableKey
from hf_bole.generation.select import WIDTH_BUCKETS, row_width, select_nodes
from hf_bole.generation.tree import DraftTree
from hf_bole.generation.verify import Verify, VerifyGraphs, trimmed
from hf_bole.kernels.utils import MAX_TREE_NODES
from hf_bole.placement import placement
from hf_bole.tensor_parallel import tensor_parallel

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZES = (1, 4, 8, 16, 32, 64, 128, 256)
DEFAULT_KV_LENGTHS = (512, 2048, 8192)
ROW_CAP = MAX_TREE_NODES - 1  # draft nodes one request's tree can hold in the verify kernels (the root not counted)
# The most tokens one prefill forward of a bucket's prompt takes, across the batch: at batch 256 a 2048-token chunk
# per row would be 524k tokens at once (13 GiB for one MLP activation of the 9B shape).
PREFILL_TOKENS = 32768
# A bucket's sweep stops past this multiple of the floor's forward (`calibrate`'s `max_ratio`).
MAX_RATIO = 2.0


def synthetic_draft_tree(
    batch_size: int, topk: int, depth: int, generator: torch.Generator, device: torch.device | str = "cpu"
) -> DraftTree:
    """Draft trees shaped like the MTP drafter's (EAGLE-2): the root's `topk` best children, then at every further
    level the `topk` best nodes of the level before (by cumulative draft probability) each get `topk` children;
    `topk + (depth - 1) * topk**2` nodes per request. Draft probabilities are the top-k of a softmax over random
    logits whose sharpness differs by request, so the batch-shared selection splits a budget unevenly, as it does
    on real drafts. Tokens are node indices (siblings stay distinct); only the shape matters for timing."""
    B, K = batch_size, topk
    on = generator.device  # built where the generator draws, then moved
    sharpness = 1.0 + 3.0 * torch.rand(B, 1, 1, generator=generator, device=on)  # per request: confident or doubtful

    def children(count: int) -> torch.Tensor:  # [B, count, K] log p_draft of the K best children of `count` nodes
        logits = torch.randn(B, count, 4 * K, generator=generator, device=on) * sharpness
        return logits.log_softmax(-1).topk(K, dim=-1).values

    logp, parents = [children(1).reshape(B, K)], [torch.full((B, K), -1, device=on)]
    cum, level = logp[0], torch.arange(K, device=on).expand(B, K)  # frontier: cumulative log p and node index
    first = K
    for _ in range(1, depth):
        best_cum, best = cum.topk(min(K, cum.shape[1]), dim=-1)  # [B, K']
        child = children(best.shape[1])  # [B, K', K]
        logp.append(child.reshape(B, -1))
        parents.append(level.gather(1, best)[..., None].expand(-1, -1, K).reshape(B, -1))
        cum = (best_cum[..., None] + child).reshape(B, -1)
        level = first + torch.arange(cum.shape[1], device=on).expand(B, -1)
        first += cum.shape[1]
    logp, parents = torch.cat(logp, 1), torch.cat(parents, 1)
    tokens = torch.arange(logp.shape[1], device=on).expand(B, -1)
    return DraftTree(tokens=tokens.to(device), parents=parents.to(device), draft_logprobs=logp.to(device))


class _Timer:
    """Median wall time of a callable in ms: CUDA events on a GPU, `time.perf_counter` elsewhere."""

    def __init__(self, device: torch.device, warmup: int, reps: int):
        self.device, self.warmup, self.reps = device, warmup, reps

    def __call__(self, fn: Callable[[], object]) -> float:
        for _ in range(self.warmup):
            fn()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            events = [
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(self.reps)
            ]
            for start, end in events:
                start.record()
                fn()
                end.record()
            torch.cuda.synchronize(self.device)
            return statistics.median(start.elapsed_time(end) for start, end in events)
        times = []
        for _ in range(self.reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


@torch.no_grad()
def calibrate(
    model,
    batch_sizes: Iterable[int] = DEFAULT_BATCH_SIZES,
    kv_lengths: Iterable[int] = DEFAULT_KV_LENGTHS,
    nodes: Iterable[int] | None = None,
    *,
    epsilon: float | None = None,
    verify: str = "closed_form",
    topk: int | None = None,
    depth: int | None = None,
    warmup: int = 3,
    reps: int = 10,
    max_ratio: float = MAX_RATIO,
    prefill_chunk: int = 2048,
    seed: int = 0,
    progress: bool = True,
    cuda_graphs: bool = True,
    compile: bool = False,
    attention: str = "auto",
    on_bucket: Callable[[BudgetTable], None] | None = None,
) -> BudgetTable:
    """Measures `T_ver(N)` and `T_commit` on `model` for every (batch size, KV length) bucket and returns the table.

    For each bucket a `BoleCache` is prefilled with random tokens to the KV length (in chunks of `prefill_chunk`
    tokens per row, at most `PREFILL_TOKENS` across the batch), and the verify forward of synthetic draft trees
    (`synthetic_draft_tree` with `topk`/`depth`, split across the batch by `select_nodes`) is timed for every `N` in
    `nodes` that the batch can hold, `N = 0` (roots only) and `batch_size <= N <= batch_size * min(127, tree size)`,
    and for `N = batch_size`, the floor of selection, in ascending order until one costs more than `max_ratio` times
    the floor; a round's commit is timed right after the floor. Each timing is the median of `reps` after `warmup` calls. A bucket that runs out
    of GPU memory before its floor and commit were timed is left out, and logged; one that runs out later keeps what
    it measured.

    Args:
        model: a Qwen3.5 model hf_bole supports, on its device, in the dtype to calibrate.
        batch_sizes, kv_lengths, nodes (`Iterable[int]`): the grid; `nodes` are total draft nodes per forward, by
            default roots only (0) and each batch size's `capacities`, where the forward's cost steps.
        epsilon (`float`, *optional*): stored with the table and used for its `budget` fields (default:
            `BoleConfig().epsilon`); look-ups may use another.
        verify (`str`): the verify mode to time, "closed_form" or "serial".
        topk, depth (`int`, *optional*): the synthetic trees' shape (default: `BoleConfig`'s).
        warmup, reps (`int`): calls before timing, and timed calls per median.
        max_ratio (`float`): a bucket's sweep stops at the first `N` whose forward costs more than this many times
            the floor's (look-ups at an epsilon of `max_ratio - 1` or more then take the last measured `N` as the
            most).
        prefill_chunk (`int`): tokens per row per prefill forward (at most `PREFILL_TOKENS` in all).
        seed (`int`): seeds the prompts and the trees.
        progress (`bool`): show a tqdm bar.
        cuda_graphs (`bool`): time the forwards as `generate` with `bole_cuda_graphs=cuda_graphs` runs them:
            replayed from CUDA graphs where `hf_bole.generation.graphs.captures` allows, launched from Python
            otherwise.
        compile (`bool`): time the `torch.compile`d verify forward (`bole_compile`); it compiles on its first call.
        attention (`str`): how the verify forward's full-attention layers attend (`bole_attention`; "auto" is
            settled by `resolve_attention` here).
        on_bucket (`Callable[[BudgetTable], None]`, *optional*): called after each bucket with the table of the
            buckets measured so far (the CLI saves it there: a run cut short keeps what it measured).

    Returns:
        `BudgetTable` keyed by `TableKey.for_model(model, verify, cuda_graphs, compile, attention)`.
    """
    from hf_bole.models import check_supported_model

    family = check_supported_model(model)
    spread = placement(model)
    if spread.spans_devices:
        raise ValueError(
            f"calibration times one GPU's forwards, but this model is spread over {len(spread.devices)} devices by its "
            f"device_map; generate gives such a model the fallback budget: pass bole_budget=<int> to fix it instead"
        )
    defaults = BoleConfig()
    epsilon = defaults.epsilon if epsilon is None else epsilon
    topk, depth = topk or defaults.topk, depth or defaults.depth
    BoleConfig(epsilon=epsilon, topk=topk, depth=depth, verify=verify, attention=attention)  # validates them
    attention = resolve_attention(attention, spread.layer_devices[0], family.tree_attention_kernel)
    given = nodes is not None
    batch_sizes, kv_lengths, nodes = sorted(set(batch_sizes)), sorted(set(kv_lengths)), sorted(set(nodes or [0]))
    if not batch_sizes or batch_sizes[0] < 1 or not kv_lengths or kv_lengths[0] < 1 or not nodes or nodes[0] < 0:
        raise ValueError(
            f"calibration needs batch sizes >= 1, KV lengths >= 1 and node counts >= 0, got {batch_sizes}, "
            f"{kv_lengths}, {nodes}"
        )
    if not max_ratio > 1:
        raise ValueError(f"max_ratio must be > 1 (the floor's forward itself is 1), got {max_ratio}")
    device = model.device
    tree_nodes = min(ROW_CAP, topk + (depth - 1) * topk**2)
    grid = {}
    for b in batch_sizes:
        grid[b] = {b}.union(n for n in nodes if n == 0 or b <= n <= b * tree_nodes)
        grid[b] = sorted(grid[b] if given else grid[b].union(capacities(b, tree_nodes)))
    timer = _Timer(device, warmup, reps)
    generator = torch.Generator().manual_seed(seed)
    key = TableKey.for_model(model, verify, cuda_graphs, compile, attention)

    meta = {
        "model_class": type(model).__name__,
        "attn_implementation": model.config.get_text_config(decoder=True)._attn_implementation,
        "topk": topk,
        "depth": depth,
        "warmup": warmup,
        "reps": reps,
        "max_ratio": max_ratio,
        "seed": seed,
        "timer": "cuda events" if device.type == "cuda" else "perf_counter",
        "launched": "replayed from CUDA graphs" if key.replayed else "from Python",
        "unit": "ms",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "versions": _versions(),
    }
    total = sum(len(kv_lengths) * (len(grid[b]) + 1) for b in batch_sizes)  # the commit counts one
    bar = _progress(total, progress)
    entries: list[BudgetEntry] = []
    for b in batch_sizes:
        for kv in kv_lengths:
            bar.set_description(f"batch {b}, KV {kv}")
            timings: dict[int | str, float] = {}  # N -> the verify forward of N draft nodes; "commit" -> a commit
            try:
                _measure_bucket(
                    model, b, kv, grid[b], timings, timer, topk, depth, verify, key.replayed,
                    compile, attention, max_ratio, prefill_chunk, generator, bar,
                )  # fmt: skip
            except torch.OutOfMemoryError:
                logger.warning(f"hf_bole calibrate: out of memory at batch {b}, KV {kv}; kept {len(timings)} timings")
            bar.update(len(grid[b]) + 1 - len(timings))  # the sizes skipped past max_ratio, or after running out
            if device.type == "cuda":
                torch.cuda.empty_cache()
            t_commit = timings.pop("commit", None)
            if b not in timings or t_commit is None:
                continue
            ns = sorted(timings)
            t_ver = [timings[n] for n in ns]
            budget = choose_budget(ns, t_ver, t_commit, b, epsilon)
            entries.append(BudgetEntry(b, kv, ns, t_ver, t_commit, budget))
            if on_bucket is not None:
                on_bucket(BudgetTable(key, epsilon, list(entries), meta))
    bar.close()
    return BudgetTable(key, epsilon, entries, meta)


def capacities(batch_size: int, tree_nodes: int = ROW_CAP) -> list[int]:
    """The most draft nodes each verify width holds at `batch_size` requests: `batch_size * (w - 1)` for every
    CUDA-graph bucket `w` (`graphs.WIDTH_BUCKETS`) whose rows hold at least one node and at most `tree_nodes`.

    A forward's cost steps up where the rows' width (root included) passes a power of two, not with each node: the
    verify kernels pad a row's nodes to a power-of-two tile (the GDN solve to at least 32), and the graphs run at
    the buckets. Timed only inside the steps, the budget rule stops short of a step's edge or just past it: 32 nodes
    at batch 1 run at width 64, where 31 fill width 32 for less. The first, `batch_size` (width 2), is selection's
    floor.

    Example:

    ```python
    >>> capacities(1, tree_nodes=68)
    [1, 3, 7, 15, 31, 63]
    >>> capacities(8)
    [8, 24, 56, 120, 248, 504, 1016]
    ```
    """
    return [batch_size * (w - 1) for w in WIDTH_BUCKETS if 1 <= w - 1 <= tree_nodes]


def _measure_bucket(
    model, b: int, kv: int, grid: list[int], timings: dict, timer: _Timer, topk: int, depth: int, verify: str,
    graphed: bool, compile: bool, attention: str, max_ratio: float, prefill_chunk: int, generator: torch.Generator,
    bar,
) -> None:  # fmt: skip
    """Fills `timings[N]` (the verify forward of `N` draft nodes) for one bucket, as they come, in ascending order
    until one costs more than `max_ratio` times the floor's, and `timings["commit"]` (a round's commit) after the
    floor's.

    Forwards run at the width the decoding loop gives them: replayed from CUDA graphs when `graphed`, at the bucket
    `row_width` picks (selection capped there), else at the widest row's exact width (`trimmed`); with hf_bole's
    SDPA backends (`attention_backends`: cuDNN's per-shape planning would make any of them look several times
    slower). Tree forwards write their KV past the committed tokens and commit nothing, so every one starts from the
    same prefilled cache; the commits, timed on a forward of the roots alone, each commit one token more, for which
    the cache has room."""
    from hf_bole.cache import BoleCache
    from hf_bole.models import attention_backends, cache_argument

    device, vocab = model.device, model.get_output_embeddings().weight.shape[0]
    decoder = model.get_decoder()
    prompt = torch.randint(0, vocab, (b, kv), generator=generator, device=generator.device).to(device)
    roots = prompt[:, -1:]
    no_parents = torch.full((b, 1), -1, dtype=torch.long, device=device)
    commits = timer.warmup + timer.reps
    chunk = max(1, min(prefill_chunk, PREFILL_TOKENS // b))
    with attention_backends():
        cache = BoleCache(
            model.config, b, max_cache_len=kv + commits + ROW_CAP + 2, device=device, dtype=model.dtype,
            key_value_heads=tensor_parallel(model).key_value_heads,
        )  # fmt: skip
        for start in range(0, kv, chunk):  # through the decoder: no logits over the whole prompt
            decoder(input_ids=prompt[:, start : start + chunk], use_cache=True,
                    **{cache_argument(type(decoder).forward): cache})  # fmt: skip
        if graphed:
            forward = VerifyGraphs(model, cache, verify, compile, attention=attention)
            commit = forward.commit
        else:
            forward = Verify(model, cache, verify, compile, True, attention, pipelined=False).forward
            commit = functools.partial(cache.commit, check_values=False)
        for n in grid:
            if n == 0:
                ids, parents = roots, no_parents
            else:
                tree = synthetic_draft_tree(b, topk, depth, generator, device)
                vt = select_nodes(tree, roots[:, 0], n, row_width(n, b, ROW_CAP + 1) - 1)
                vt = vt if graphed else trimmed(vt)
                ids, parents = vt.input_ids, vt.parents
            timings[n] = timer(functools.partial(forward, ids, parents))
            bar.update(1)
            if n == b:
                timings["commit"] = _time_commit(cache, forward(roots, no_parents).tree_round, commit, timer)
                bar.update(1)
            if n > b and timings[n] > max_ratio * timings[b]:
                return


def _time_commit(cache, tree_round, commit, timer: _Timer) -> float:
    """A round's commit: one token (each row's root) of `tree_round`, committed again and again (the round is marked
    verified from the state each commit leaves: the cost is the same)."""
    path = torch.zeros(cache.batch_size, 1, dtype=torch.long, device=cache.device)

    def one() -> None:
        cache.mark_verified(tree_round)  # host-side only
        commit(tree_round, path)

    return timer(one)


def plot_table(table: BudgetTable, path: str | Path, epsilon: float | None = None) -> Path:
    """A round's cost `T(N) / T(floor)` (`T = T_ver + T_commit`) against `N`, one panel per batch size and one line
    per KV length, the thresholds dashed (`1 + epsilon` for the budget; `1 / (1 + epsilon)` for the roots alone at
    `N = 0`, drawn at 0.5: below it the budget is 0, plain decoding) and every chosen budget circled. Needs
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("plotting the budget table needs matplotlib: pip install matplotlib") from e
    epsilon = table.epsilon if epsilon is None else epsilon
    batches = sorted({e.batch_size for e in table.entries})
    columns = min(len(batches), 4)
    rows = -(-len(batches) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.5 * columns, 3.8 * rows), squeeze=False, sharey=True)
    for ax, b in zip(axes.flat, batches):
        for e in (e for e in table.entries if e.batch_size == b):
            floor = e.t_floor + e.t_commit
            ratio = [(t + e.t_commit) / floor for t in e.t_ver]
            x = [n or 0.5 for n in e.nodes]  # N = 0 (roots only) drawn at 0.5 on the log axis, below the floor's
            (line,) = ax.plot(x, ratio, marker=".", label=f"KV {e.kv_length}")
            chosen = entry_budget(e, epsilon)
            i = e.nodes.index(chosen) if chosen in e.nodes else None
            if i is not None:
                ax.plot([x[i]], [ratio[i]], "o", ms=11, mfc="none", color=line.get_color())
        for limit in (1 + epsilon, 1 / (1 + epsilon)):
            ax.axhline(limit, ls="--", color="grey", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_title(f"batch {b}")
        ax.set_xlabel("draft nodes N per forward (0.5 = roots only)")
        ax.legend(fontsize=8)
    for ax in axes.flat[len(batches) :]:
        ax.set_visible(False)
    for ax in axes[:, 0]:
        ax.set_ylabel("T(N) / T(floor), T = T_ver + T_commit")
    fig.suptitle(f"{table.key.model}, {table.key.device}, {table.key.dtype}, {table.key.verify}: circled = "
                 f"the budget at epsilon {epsilon}", fontsize=9)  # fmt: skip
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _progress(total: int, enabled: bool):
    try:
        from tqdm.auto import tqdm
    except ImportError:
        enabled = False
    if not enabled:
        return _NoBar()
    return tqdm(total=total, unit="timing")


class _NoBar:
    def update(self, n: int = 1) -> None: ...
    def set_description(self, text: str) -> None: ...
    def close(self) -> None: ...


def _versions() -> dict:
    import transformers

    out = {"torch": torch.__version__, "transformers": transformers.__version__}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        pass
    return out
