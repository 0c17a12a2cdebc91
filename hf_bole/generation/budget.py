"""The verification budget (DESIGN.md §5): how many draft nodes one verify forward takes while it still costs about
the least forward a round runs. Calibrated once per (model, GPU, dtype, verify mode, launch), stored as a table,
looked up every round.

    B_ver = max{N : T_ver(N) <= (1 + epsilon) T_dec}

`T_ver(N)` is the complete verify forward (`tree_forward`: every layer, the LM head over every node) of a batch of
draft trees holding `N` draft nodes in all, plus one root per request, from a cache prefilled to the KV-length
bucket, at the width `generate` gives it: selection caps every request at the CUDA-graph bucket that holds `N` split
evenly over the requests (`graphs.row_width`), and a forward launched from Python is cut to the widest request's
exact width. Forwards are timed as `generate` launches them: replayed from CUDA graphs (`bole_cuda_graphs`, the
default on CUDA for dense models) or launched from Python. All run with hf_bole's SDPA backends
(`hf_bole.models.attention_backends`). The trees are MTP/EAGLE-2-shaped (`topk` children of the `topk` best nodes per
level, random draft probabilities, confidence differing by request) and the batch-shared selection splits `N` across
requests as in the decoding loop.

`T_dec` is `T_ver(batch size)`: the forward of selection's floor, each request's best root child, the least a round
verifies (`select_nodes`), timed the same way. DESIGN.md's decode step, the roots-only forward, is cheaper than any
forward a round runs, by a cost that comes with the tree's width, not with its nodes: against it a small model's
budget can fall to the floor although a tree of a few dozen nodes costs a round little more than the floor's forward.
Every budget is thus at least the batch size; `N = 0` (roots only) is measured for the plot, not chosen.

A table is keyed by the model's text config (`model_key`), the device name, the dtype, the verify mode and the
launch ("graphs" or "eager"), and holds one entry per (batch size, KV length) bucket with the raw timings, so a
different epsilon applies at look-up without measuring again. One JSON file per key (`TableKey.filename`); "auto"
reads the first it finds in `table_dirs()`: the user's `$HF_BOLE_CACHE/budgets/` (default
`~/.cache/hf_bole/budgets/`), where `python -m hf_bole.calibrate` writes, then the tables shipped in the package
(`hf_bole/budgets/`). The key holds the shape, not the weights, so a table measured on a random-weight model of a
published shape (`hf_bole.shapes`) serves that checkpoint. Look-up takes, in each batch bucket, the
KV bucket at or below the longest active request's committed length (the smallest bucket when below all of them):
KV bucket i covers the range up to the next one, which is optimistic (a longer context turns compute-bound a little
sooner), so put KV buckets where the budget changes fast. Between two batch buckets the epsilon rule's budget follows
the line between theirs, by the number of active requests (outside them, the nearest bucket's; `GoodputRule` reads
the bucket at or below): a batch shrinks as its rows finish, and the budget can rise with the batch as well as fall.
With budgets of 32, 64 and 384 nodes at 1, 4 and 8 requests, the bucket at or below would verify 64 nodes for a
batch of 8 once one row had finished and 32 once five had.

Example:

```python
>>> from hf_bole.generation.budget import calibrate, BudgetResolver
>>> table = calibrate(model, batch_sizes=(1, 8), kv_lengths=(1024,))  # minutes on a GPU
>>> table.save(table.default_path())
>>> BudgetResolver.from_table(table, epsilon=0.1)(active_rows=8, kv_length=1500)
96
```
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import itertools
import json
import logging
import os
import re
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from hf_bole.config import (
    AUTO_BUDGET,
    FALLBACK_BUDGET_MAX,
    FALLBACK_BUDGET_PER_REQUEST,
    GOODPUT_BUDGET,
    BoleConfig,
    resolve_attention,
)
from hf_bole.generation.graphs import WIDTH_BUCKETS, VerifyGraphs, captures, row_width, trimmed
from hf_bole.generation.select import select_nodes
from hf_bole.generation.tree import DraftTree, VerifyTree
from hf_bole.placement import placement
from hf_bole.kernels.tree_gdn.closed_form import MAX_NODES

logger = logging.getLogger(__name__)
PACKAGE_TABLES = Path(__file__).resolve().parents[1] / "budgets"  # the tables shipped with hf_bole

# 2: keyed by how forwards launch (CUDA graphs or eager) too; 3: T_dec is the floor's forward; 4: replayed forwards
# timed at `row_width`'s bucket, no longer at the widest row's
FORMAT_VERSION = 4
DEFAULT_BATCH_SIZES = (1, 4, 8, 16)
DEFAULT_KV_LENGTHS = (512, 2048, 8192)
ROW_CAP = MAX_NODES - 1  # draft nodes one request's tree can hold in the verify kernels (the root not counted)
# Fields of a text config that set the cost of a forward; the model key hashes them.
_SHAPE_FIELDS = (
    "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "layer_types", "num_attention_heads",
    "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
    "linear_value_head_dim", "linear_conv_kernel_dim", "intermediate_size", "num_experts", "num_experts_per_tok",
    "moe_intermediate_size", "shared_expert_intermediate_size",
)  # fmt: skip
_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning(message)


def _say_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        logger.info(message)


def choose_budget(nodes: Sequence[int], t_ver: Sequence[float], t_dec: float, epsilon: float) -> int:
    """`B_ver = max{N : T_ver(N) <= (1 + epsilon) T_dec}` over the measured sizes, or 0 when none qualifies.

    Every measured size counts, not only a prefix of them: when timings are not monotone in `N` (a wider forward
    that happens to tile better), a larger qualifying `N` wins over a smaller one that did not qualify.

    Args:
        nodes (`Sequence[int]`): total draft nodes per forward, one per timing.
        t_ver (`Sequence[float]`): the verify forward's time at each of them.
        t_dec (`float`): the least forward a round runs (the floor's, `T_ver(batch size)`), in the unit of `t_ver`.
        epsilon (`float`): the slack, >= 0.

    Returns:
        `int`: the budget.

    Example:

    ```python
    >>> choose_budget([0, 16, 32, 64], [1.05, 1.08, 1.12, 1.5], t_dec=1.0, epsilon=0.1)
    16
    ```
    """
    if len(nodes) != len(t_ver):
        raise ValueError(f"{len(nodes)} node counts but {len(t_ver)} timings")
    if epsilon < 0:
        raise ValueError(f"epsilon must be >= 0, got {epsilon}")
    limit = (1 + epsilon) * t_dec
    return max((n for n, t in zip(nodes, t_ver) if t <= limit), default=0)


def choose_goodput(
    nodes: Sequence[int], t_ver: Sequence[float], gain: Sequence[float], fixed: float, rows: int, max_budget: int
) -> int:
    """The measured size `N >= 1` (at most `max_budget`) of most expected tokens per millisecond,
    `(rows + gain(N)) / (T_ver(N) + fixed)`; the smallest of equals.

    Args:
        nodes, t_ver (`Sequence[int]`, `Sequence[float]`): a table entry's sizes and verify times (ms).
        gain (`Sequence[float]`): the batch's draft nodes' cumulative draft probabilities, best first: what each is
            expected to add to the accepted tokens (nodes past its end add nothing).
        fixed (`float`): the rest of a round in ms (drafting, acceptance, commit, the host), >= 0.
        rows (`int`): the active requests, each of which gains its bonus token every round.
        max_budget (`int`): the largest size allowed.

    Returns:
        `int`: the budget, or 0 when the entry holds no size in `[1, max_budget]`.

    Example:

    ```python
    >>> # nodes 9-16 add 0.4 tokens for 0.5 ms: (1 + 3.4) / 10.5 beats (1 + 3.0) / 10; nodes 17-32 add nothing
    >>> choose_goodput([0, 8, 16, 32], [9.0, 9.0, 9.5, 14.0], gain=[0.5] * 4 + [0.25] * 4 + [0.05] * 8,
    ...                fixed=1.0, rows=1, max_budget=64)
    16
    ```
    """
    if len(nodes) != len(t_ver):
        raise ValueError(f"{len(nodes)} node counts but {len(t_ver)} timings")
    if fixed < 0 or rows < 1:
        raise ValueError(f"fixed must be >= 0 and rows >= 1, got {fixed} and {rows}")
    cumulative = list(itertools.accumulate(gain)) or [0.0]
    best, best_rate = 0, -1.0
    for n, t in sorted(zip(nodes, t_ver)):
        if not 1 <= n <= max_budget:
            continue
        rate = (rows + cumulative[min(n, len(cumulative)) - 1]) / (t + fixed)
        if rate > best_rate:
            best, best_rate = n, rate
    return best


def fallback_budget(active_rows: int) -> int:
    """The documented budget of `budget="auto"` without a table: `FALLBACK_BUDGET_PER_REQUEST` (31) draft nodes per
    active request, at most `FALLBACK_BUDGET_MAX` (128) a round (`hf_bole.config`)."""
    return max(1, min(FALLBACK_BUDGET_PER_REQUEST * active_rows, FALLBACK_BUDGET_MAX))


def cache_dir() -> Path:
    """Where `python -m hf_bole.calibrate` writes tables: `$HF_BOLE_CACHE/budgets`, by default
    `~/.cache/hf_bole/budgets`."""
    return Path(os.environ.get("HF_BOLE_CACHE") or Path.home() / ".cache" / "hf_bole").expanduser() / "budgets"


def table_dirs() -> list[Path]:
    """Where "auto" looks for a table, in order: the user's `cache_dir()`, then the tables shipped with hf_bole."""
    return [cache_dir(), PACKAGE_TABLES]


def model_key(config) -> str:
    """A name for the cost-relevant shape of a model: `<model_type>-h<hidden>-l<layers>-<hash of the shape fields>`.
    Takes a model or its config (composite configs use their text config). A field the config's class does not
    define counts as unset: a checkpoint's config.json may carry keys its class ignores (`intermediate_size` in a
    mixture-of-experts config), which change nothing about the forward."""
    config = getattr(config, "config", config).get_text_config(decoder=True)
    defined = _defined_fields(type(config))
    shape = {name: getattr(config, name, None) if name in defined else None for name in _SHAPE_FIELDS}
    digest = hashlib.sha1(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()[:10]
    return f"{config.model_type}-h{config.hidden_size}-l{config.num_hidden_layers}-{digest}"


@functools.cache
def _defined_fields(config_class: type) -> frozenset[str]:
    """The shape fields a config class sets itself (on a default instance)."""
    default = config_class()
    return frozenset(name for name in _SHAPE_FIELDS if hasattr(default, name))


def device_name(device: torch.device | str) -> str:
    """The GPU's name (`torch.cuda.get_device_name`), or the device type elsewhere ("cpu")."""
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class TableKey:
    """What a calibration table is valid for."""

    model: str  # `model_key`
    device: str  # `device_name`
    dtype: str  # e.g. "bfloat16"
    verify: str  # "closed_form" or "serial"
    # "graphs" (forwards replayed from CUDA graphs) or "eager" (kernels launched from Python), prefixed "compiled-"
    # for the torch.compile'd forward (`bole_compile`) and "triton-attention-" for `bole_attention="triton"`
    launch: str

    @classmethod
    def for_model(
        cls,
        model,
        verify: str = "closed_form",
        cuda_graphs: bool = True,
        compile: bool = False,
        attention: str = "auto",
    ) -> TableKey:
        """The key of the forwards `generate` runs for `model` with `bole_verify=verify`,
        `bole_cuda_graphs=cuda_graphs` (graphs only where `hf_bole.generation.graphs.captures` says so),
        `bole_compile=compile` and `bole_attention=attention`."""
        # The GPU its forwards run on (under accelerate hooks `model.device` may name a parameter left elsewhere).
        place = placement(model)
        device = place.input_device
        attention = resolve_attention(attention, place.layer_devices[0])
        launch = "compiled-" * compile + "triton-attention-" * (attention == "triton")
        launch += "graphs" if captures(model, cuda_graphs) else "eager"
        return cls(model_key(model), device_name(device), dtype_name(model.dtype), verify, launch)

    @property
    def replayed(self) -> bool:
        """Whether the timed forwards replay from CUDA graphs (compiled or not)."""
        return self.launch.endswith("graphs")

    @property
    def filename(self) -> str:
        device = re.sub(r"[^A-Za-z0-9.]+", "-", self.device).strip("-")
        return f"{self.model}__{device}__{self.dtype}__{self.verify}__{self.launch}.json"


@dataclass
class BudgetEntry:
    """The timings of one (batch size, KV length) bucket, in milliseconds. `budget` is `choose_budget` at the
    table's epsilon; look-ups with another epsilon choose again from the timings."""

    batch_size: int
    kv_length: int
    t_dec: float
    nodes: list[int]
    t_ver: list[float]
    budget: int

    def choose(self, epsilon: float) -> int:
        return choose_budget(self.nodes, self.t_ver, self.t_dec, epsilon)


@dataclass
class BudgetTable:
    """A calibration table: timings per (batch size, KV length) bucket for one `TableKey`.

    Args:
        key (`TableKey`): model, device, dtype and verify mode the timings hold for.
        epsilon (`float`): the epsilon the entries' `budget` fields were chosen with.
        entries (`list[BudgetEntry]`): one per measured bucket.
        meta (`dict`): how it was measured (tree shape, repetitions, library versions, model class).
    """

    key: TableKey
    epsilon: float
    entries: list[BudgetEntry]
    meta: dict = field(default_factory=dict)

    def default_path(self) -> Path:
        return cache_dir() / self.key.filename

    def to_dict(self) -> dict:
        return {"format": FORMAT_VERSION, "key": asdict(self.key), "epsilon": self.epsilon, "meta": self.meta,
                "entries": [asdict(e) for e in self.entries]}  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict) -> BudgetTable:
        if data.get("format") != FORMAT_VERSION:
            raise ValueError(f"budget table format {data.get('format')!r} is not {FORMAT_VERSION}: calibrate again")
        return cls(
            key=TableKey(**data["key"]),
            epsilon=data["epsilon"],
            entries=[BudgetEntry(**e) for e in data["entries"]],
            meta=data.get("meta", {}),
        )

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        tmp.replace(path)  # readers never see half a table
        return path

    @classmethod
    def load(cls, path: str | Path) -> BudgetTable:
        return cls.from_dict(json.loads(Path(path).read_text()))


def find_table(key: TableKey, folder: str | Path | None = None) -> BudgetTable | None:
    """The stored table for `key` in `folder` (default: the first of `table_dirs()` that holds one), or None. Read
    once per file version."""
    for path in [Path(folder) / key.filename] if folder is not None else [d / key.filename for d in table_dirs()]:
        try:
            mtime = path.stat().st_mtime_ns
        except FileNotFoundError:
            continue
        return _load_cached(path, mtime)
    return None


_TABLES: dict[tuple[Path, int], BudgetTable] = {}


def _load_cached(path: Path, mtime: int) -> BudgetTable:
    if (path, mtime) not in _TABLES:
        _TABLES[(path, mtime)] = BudgetTable.load(path)
    return _TABLES[(path, mtime)]


def _bucket_index(buckets: Sequence[int], value: int) -> int:
    """The index of the largest bucket <= value, or 0 when value is below all (buckets sorted ascending)."""
    return max(bisect.bisect_right(buckets, value) - 1, 0)


def _bucket(buckets: Sequence[int], value: int) -> int:
    return buckets[_bucket_index(buckets, value)]


class BudgetResolver:
    """The budget of every round: `resolver(active_rows, kv_length) -> int`, from a fixed number, a calibration
    table, or the fallback. Host-side only (dict and bisect look-ups); `max_budget` bounds every answer, so the
    decoding loop can size its buffers once. After selection the loop hands each round's draft trees to
    `observe`, which only the goodput rule reads (`GoodputRule`).

    Build with `for_model` (what `generate` does), `from_table`, `goodput`, `fixed` or `fallback`.
    """

    def __init__(self, rule: Callable[[int, int], int], max_budget: int, source: str):
        self._rule, self.max_budget, self.source = rule, max_budget, source

    def __call__(self, active_rows: int, kv_length: int) -> int:
        """The budget for a round with `active_rows` requests still decoding, the longest of which has committed
        `kv_length` tokens (left padding included)."""
        return self._rule(active_rows, kv_length)

    def observe(self, verify: VerifyTree) -> None:
        """This round's selection (`select_nodes`' output: its `draft_log_rho` ranks every draft node, finished rows'
        at -inf)."""
        if isinstance(self._rule, GoodputRule):
            self._rule.observe(verify)

    def __repr__(self) -> str:
        return f"BudgetResolver({self.source}, max_budget={self.max_budget})"

    @classmethod
    def fixed(cls, budget: int) -> BudgetResolver:
        return cls(lambda active_rows, kv_length: budget, budget, f"fixed {budget}")

    @classmethod
    def fallback(cls, batch_size: int) -> BudgetResolver:
        return cls(lambda active_rows, kv_length: fallback_budget(active_rows), fallback_budget(batch_size), "fallback")

    @classmethod
    def from_table(cls, table: BudgetTable, epsilon: float) -> BudgetResolver:
        """Looks budgets up in `table`, chosen from its timings at `epsilon`, between batch buckets on the line
        between theirs (`_interpolated_budget`)."""
        rule = _interpolated_budget(table, epsilon)
        max_budget = max(e.choose(epsilon) for e in table.entries)
        return cls(rule, max_budget, f"table {table.key.filename} at epsilon {epsilon}")

    @classmethod
    def goodput(cls, table: BudgetTable, epsilon: float) -> BudgetResolver:
        """Chooses every round the budget of most expected tokens per millisecond (`GoodputRule`) from `table`'s
        timings; the first round, with nothing observed yet, takes `epsilon`'s budget."""
        rule = GoodputRule(table, epsilon)
        return cls(rule, rule.max_budget, f"goodput over table {table.key.filename}")

    @classmethod
    def for_model(cls, model, config: BoleConfig, batch_size: int) -> BudgetResolver:
        """What `generate` uses: a fixed budget for an int `config.budget`; for `"auto"` (`"goodput"`) the stored
        table of this model, device, dtype and verify mode at `config.epsilon` (under the goodput rule), or the
        fallback, said once in a log line."""
        if config.budget not in (AUTO_BUDGET, GOODPUT_BUDGET):
            return cls.fixed(config.budget)
        place = placement(model)
        device = place.input_device
        fallback = (
            f"budget={config.budget!r} uses the fallback of {FALLBACK_BUDGET_PER_REQUEST} draft nodes per active "
            f"request, at most {FALLBACK_BUDGET_MAX} per round (pass bole_budget=<int> to fix it)"
        )
        if device.type != "cuda":
            _warn_once(f"hf_bole: no calibrated verification budget on {device.type}: {fallback}")
            return cls.fallback(batch_size)
        if place.spans_devices:
            # A table times one GPU's forwards; one of this model on a single GPU would not fit its spread forwards.
            _warn_once(
                f"hf_bole: no calibrated verification budget for a model spread over {len(place.devices)} devices "
                f"(calibration times forwards on one GPU): {fallback}"
            )
            return cls.fallback(batch_size)
        key = TableKey.for_model(model, config.verify, config.cuda_graphs, config.compile, config.attention)
        table = None
        for folder in table_dirs():
            try:
                table = find_table(key, folder)
            except ValueError as unreadable:  # an older format (its T_dec meant another forward), or not a table
                _warn_once(
                    f"hf_bole: the verification budget table {folder / key.filename} cannot be used ({unreadable}); "
                    f"skipped. Measure it again with {_calibrate_command(model, key, config)}."
                )
                continue
            if table is not None:
                path = folder / key.filename
                _say_once(f"hf_bole: budget={config.budget!r} reads the verification budget table {path}")
                break
        if table is None:
            _warn_once(
                f"hf_bole: no verification budget table {key.filename} for this model, GPU ({key.device}), dtype, "
                f"verify mode and launch ({key.launch}) in {' or '.join(str(d) for d in table_dirs())}; {fallback}. "
                f"Measure one with {_calibrate_command(model, key, config)}."
            )
            return cls.fallback(batch_size)
        if config.budget == GOODPUT_BUDGET:
            return cls.goodput(table, config.epsilon)
        return cls.from_table(table, config.epsilon)


def _calibrate_command(model, key: TableKey, config: BoleConfig) -> str:
    """The `python -m hf_bole.calibrate` command that measures `key`'s table (for the log lines of a missing one)."""
    flags = " --no-cuda-graphs" if not key.replayed and captures(model, True) else ""
    # calibrate's --attention is "auto" too, which on a GPU is the kernel
    flags += " --compile" * config.compile + " --attention model" * ("triton-attention-" not in key.launch)
    return f"`python -m hf_bole.calibrate --model <checkpoint> --dtype {key.dtype} --verify {key.verify}{flags}`"


def _entry_lookup(table: BudgetTable) -> Callable[[int, int], BudgetEntry]:
    """`(active_rows, kv_length) -> entry`: the batch bucket at or below `active_rows`, then the KV bucket at or
    below `kv_length` (the smallest bucket below all)."""
    if not table.entries:
        raise ValueError(f"the budget table for {table.key} has no entries")
    by_batch: dict[int, tuple[list[int], list[BudgetEntry]]] = {}  # batch bucket -> (kv buckets, entries)
    for entry in sorted(table.entries, key=lambda e: (e.batch_size, e.kv_length)):
        kvs, entries = by_batch.setdefault(entry.batch_size, ([], []))
        kvs.append(entry.kv_length)
        entries.append(entry)
    batch_buckets = sorted(by_batch)

    def entry_for(active_rows: int, kv_length: int) -> BudgetEntry:
        kvs, entries = by_batch[_bucket(batch_buckets, active_rows)]
        return entries[_bucket_index(kvs, kv_length)]

    return entry_for


def _interpolated_budget(table: BudgetTable, epsilon: float) -> Callable[[int, int], int]:
    """`(active_rows, kv_length) -> budget` under the epsilon rule: at a batch bucket, the budget of its entry at
    the KV bucket at or below `kv_length` (`_entry_lookup`); between two batch buckets, the line between their
    budgets at the active rows, rounded; below the smallest batch bucket or above the largest, that bucket's."""
    entry_for = _entry_lookup(table)
    chosen = {id(e): e.choose(epsilon) for e in table.entries}
    batch_buckets = sorted({e.batch_size for e in table.entries})

    def at(batch_bucket: int, kv_length: int) -> int:
        return chosen[id(entry_for(batch_bucket, kv_length))]

    def budget(active_rows: int, kv_length: int) -> int:
        i = _bucket_index(batch_buckets, active_rows)
        low = batch_buckets[i]
        if active_rows <= low or i + 1 == len(batch_buckets):
            return at(low, kv_length)
        high = batch_buckets[i + 1]
        below, above = at(low, kv_length), at(high, kv_length)
        return round(below + (above - below) * (active_rows - low) / (high - low))

    return budget


class GoodputRule:
    """`bole_budget="goodput"`: every round, the table's size `N` of most expected tokens per millisecond,
    `(rows + gain(N)) / (T_ver(N) + fixed)` (`choose_goodput`), where

    - `T_ver(N)` is the table's verify forward at the round's (batch, KV) bucket;
    - `gain(N)`, what the `N` best draft nodes add to the accepted tokens, sums their cumulative draft probabilities
      (exact for a calibrated drafter under greedy acceptance), taken from the batch's trees of the rounds before:
      `observe` sorts them on the device and copies them to the host without waiting, and the round's one
      synchronisation (the stopping rules' read) has them there before the next round asks;
    - `fixed` is the rest of a round (drafting, acceptance, commit, the host): the host's wall time from one round's
      start to the next, less the table's `T_ver` of the budget it ran.

    Both estimates are running averages (weight `decay` on the past), so one odd round does not swing the budget. The
    first round, before any estimate, takes the epsilon rule's budget. The epsilon rule keeps a budget while the
    verify forward stays nearly free; this one also weighs what the nodes would yield (with few confident nodes it
    verifies fewer, with many more) and what the rest of the round costs.
    """

    def __init__(self, table: BudgetTable, epsilon: float, decay: float = 0.7):
        self._entry_for = _entry_lookup(table)
        self._first = {id(e): e.choose(epsilon) for e in table.entries}
        self.max_budget = max(n for e in table.entries for n in e.nodes) or 1
        self.decay = decay
        self.gain: torch.Tensor | None = None  # [max_budget] float32 on the host, running average
        self.fixed: float | None = None  # ms
        self._pending: tuple[torch.Tensor, torch.cuda.Event | None] | None = None  # the last observed round's copy
        self._last: tuple[float, float] | None = None  # (host time at the last round's start, its T_ver in ms)
        self._host: torch.Tensor | None = None  # pinned, on CUDA

    def __call__(self, active_rows: int, kv_length: int) -> int:
        now = time.perf_counter()
        if self._pending is not None:
            sorted_rho, copied = self._pending
            if copied is not None:
                copied.synchronize()  # already done: the round's stopping read waited for it
            self.gain = self._average(self.gain, sorted_rho)
            self._pending = None
        if self._last is not None:
            started, t_ver = self._last
            self.fixed = self._average(self.fixed, max(0.0, 1e3 * (now - started) - t_ver))
        entry = self._entry_for(active_rows, kv_length)
        if self.gain is None or self.fixed is None:
            budget = self._first[id(entry)]
        else:
            gain = self.gain.tolist()
            budget = choose_goodput(entry.nodes, entry.t_ver, gain, self.fixed, active_rows, self.max_budget)
            budget = budget or self._first[id(entry)]
        # The table's time at the size measured nearest below the budget
        i = max(bisect.bisect_right(entry.nodes, budget) - 1, 0)
        self._last = (now, entry.t_ver[i])
        return budget

    def observe(self, verify: VerifyTree) -> None:
        """Enqueues the sort of the draft nodes by cumulative draft probability (`verify.draft_log_rho`, which
        selection formed) and its copy to the host."""
        rho = verify.draft_log_rho.exp().flatten()  # [B * N]; padding, finished rows and NaN: 0 (log rho -inf)
        k = min(self.max_budget, rho.numel())
        best = torch.nn.functional.pad(rho.topk(k).values.float(), (0, self.max_budget - k))  # [max_budget], descending
        if not best.is_cuda:
            self._pending = (best, None)
            return
        if self._host is None:  # read by the next round's call before this round's copy overwrites it
            self._host = torch.empty(self.max_budget, pin_memory=True)
        self._host.copy_(best, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        self._pending = (self._host, copied)

    def _average(self, old, new):
        if old is None:
            return new.clone() if isinstance(new, torch.Tensor) else new
        return self.decay * old + (1 - self.decay) * new


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
    prefill_chunk: int = 2048,
    seed: int = 0,
    progress: bool = True,
    cuda_graphs: bool = True,
    compile: bool = False,
    attention: str = "auto",
    on_bucket: Callable[[BudgetTable], None] | None = None,
) -> BudgetTable:
    """Measures `T_ver(N)` on `model` for every (batch size, KV length) bucket and returns the table.

    For each bucket a `BoleCache` is prefilled with random tokens to the KV length (in chunks of `prefill_chunk`),
    and the verify forward of synthetic draft trees (`synthetic_draft_tree` with `topk`/`depth`, split across the
    batch by `select_nodes`) is timed for every `N` in `nodes` that the batch can hold, `N = 0` (roots only) and
    `batch_size <= N <= batch_size * min(127, tree size)`, and for `N = batch_size`, the floor of selection, whose
    time is the entry's `T_dec`. Each timing is the median of `reps` after `warmup` calls. A bucket that runs out of
    GPU memory before its floor was timed is left out, and logged; one that runs out later keeps what it measured.

    Args:
        model: a Qwen3.5 model hf_bole supports, on its device, in the dtype to calibrate.
        batch_sizes, kv_lengths, nodes (`Iterable[int]`): the grid; `nodes` are total draft nodes per forward, by
            default roots only (0) and each batch size's `capacities`, where the forward's cost steps.
        epsilon (`float`, *optional*): stored with the table and used for its `budget` fields (default:
            `BoleConfig().epsilon`); look-ups may use another.
        verify (`str`): the verify mode to time, "closed_form" or "serial".
        topk, depth (`int`, *optional*): the synthetic trees' shape (default: `BoleConfig`'s).
        warmup, reps (`int`): calls before timing, and timed calls per median.
        prefill_chunk (`int`): tokens per row per prefill forward.
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

    check_supported_model(model)
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
    attention = resolve_attention(attention, spread.layer_devices[0])
    given = nodes is not None
    batch_sizes, kv_lengths, nodes = sorted(set(batch_sizes)), sorted(set(kv_lengths)), sorted(set(nodes or [0]))
    if not batch_sizes or batch_sizes[0] < 1 or not kv_lengths or kv_lengths[0] < 1 or not nodes or nodes[0] < 0:
        raise ValueError(
            f"calibration needs batch sizes >= 1, KV lengths >= 1 and node counts >= 0, got {batch_sizes}, "
            f"{kv_lengths}, {nodes}"
        )
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
        "seed": seed,
        "timer": "cuda events" if device.type == "cuda" else "perf_counter",
        "t_dec": "floor verify forward (N = batch size), " + ("replayed" if key.replayed else "launched from Python"),
        "unit": "ms",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "versions": _versions(),
    }
    total = sum(len(kv_lengths) * len(grid[b]) for b in batch_sizes)
    bar = _progress(total, progress)
    entries: list[BudgetEntry] = []
    for b in batch_sizes:
        for kv in kv_lengths:
            bar.set_description(f"batch {b}, KV {kv}")
            timings: dict[int, float] = {}  # N -> the verify forward of N draft nodes
            try:
                _measure_bucket(
                    model, b, kv, grid[b], timings, timer, topk, depth, verify, key.replayed,
                    compile, attention, prefill_chunk, generator, bar,
                )  # fmt: skip
            except torch.OutOfMemoryError:
                logger.warning(f"hf_bole calibrate: out of memory at batch {b}, KV {kv}; kept {len(timings)} timings")
                bar.update(len(grid[b]) - len(timings))
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if b not in timings:
                continue
            ns = sorted(timings)
            t_ver = [timings[n] for n in ns]
            entries.append(BudgetEntry(b, kv, timings[b], ns, t_ver, choose_budget(ns, t_ver, timings[b], epsilon)))
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
    at batch 1 run at width 64, where 31 fill width 32 for less.

    Example:

    ```python
    >>> capacities(1, tree_nodes=68)
    [3, 7, 15, 31, 63]
    >>> capacities(8)
    [24, 56, 120, 248, 504, 1016]
    ```
    """
    return [batch_size * (w - 1) for w in WIDTH_BUCKETS if 1 <= w - 1 <= tree_nodes]


def _measure_bucket(
    model, b: int, kv: int, grid: list[int], timings: dict, timer: _Timer, topk: int, depth: int, verify: str,
    graphed: bool, compile: bool, attention: str, prefill_chunk: int, generator: torch.Generator, bar,
) -> None:  # fmt: skip
    """Fills `timings[N]` (the verify forward of `N` draft nodes) for one bucket, as they come.

    Forwards run at the width the decoding loop gives them: replayed from CUDA graphs when `graphed`, at the bucket
    `row_width` picks (selection capped there), else at the widest row's exact width (`trimmed`); with hf_bole's
    SDPA backends (`attention_backends`: cuDNN's per-shape planning would make any of them look several times
    slower). Tree forwards write their KV past the committed tokens and commit nothing, so every one starts from the
    same prefilled cache."""
    from hf_bole.cache import BoleCache
    from hf_bole.models import attention_backends, cache_argument, tree_forward

    device, vocab = model.device, model.get_output_embeddings().weight.shape[0]
    decoder = model.get_decoder()
    prompt = torch.randint(0, vocab, (b, kv), generator=generator, device=generator.device).to(device)
    roots = prompt[:, -1:]
    no_parents = torch.full((b, 1), -1, dtype=torch.long, device=device)
    with attention_backends():
        cache = BoleCache(model.config, b, max_cache_len=kv + ROW_CAP + 2, device=device, dtype=model.dtype)
        for start in range(0, kv, prefill_chunk):  # through the decoder: no logits over the whole prompt
            chunk = prompt[:, start : start + prefill_chunk]
            decoder(input_ids=chunk, use_cache=True, **{cache_argument(type(decoder).forward): cache})
        if graphed:
            forward = VerifyGraphs(model, cache, verify, compile, attention=attention)
        else:
            forward = functools.partial(
                tree_forward, model, cache, verify=verify, compile=compile, attention=attention
            )
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


def plot_table(table: BudgetTable, path: str | Path, epsilon: float | None = None) -> Path:
    """`T_ver(N) / T_dec` against `N`, one panel per batch size and one line per KV length, the threshold
    `1 + epsilon` dashed and every chosen budget circled. Needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("plotting the budget table needs matplotlib: pip install matplotlib") from e
    epsilon = table.epsilon if epsilon is None else epsilon
    batches = sorted({e.batch_size for e in table.entries})
    fig, axes = plt.subplots(1, len(batches), figsize=(4.5 * len(batches), 3.8), squeeze=False, sharey=True)
    for ax, b in zip(axes[0], batches):
        for e in (e for e in table.entries if e.batch_size == b):
            ratio = [t / e.t_dec for t in e.t_ver]
            x = [n or 0.5 for n in e.nodes]  # N = 0 (roots only) drawn at 0.5 on the log axis, below the floor's 1
            (line,) = ax.plot(x, ratio, marker=".", label=f"KV {e.kv_length}")
            chosen = e.choose(epsilon)
            i = e.nodes.index(chosen) if chosen in e.nodes else None
            if i is not None:
                ax.plot([x[i]], [ratio[i]], "o", ms=11, mfc="none", color=line.get_color())
        ax.axhline(1 + epsilon, ls="--", color="grey", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_title(f"batch {b}")
        ax.set_xlabel("draft nodes N per forward (0.5 = roots only)")
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("T_ver(N) / T_dec")
    fig.suptitle(f"{table.key.model}, {table.key.device}, {table.key.dtype}, {table.key.verify}: circled = "
                 f"B_ver at epsilon {epsilon}", fontsize=9)  # fmt: skip
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


__all__ = [
    "BudgetEntry",
    "GoodputRule",
    "BudgetResolver",
    "BudgetTable",
    "TableKey",
    "cache_dir",
    "calibrate",
    "capacities",
    "choose_budget",
    "choose_goodput",
    "fallback_budget",
    "find_table",
    "model_key",
    "plot_table",
    "synthetic_draft_tree",
    "table_dirs",
]
