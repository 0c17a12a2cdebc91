"""The verification budget's rule (DESIGN.md §5) and its look-up every round: how many draft nodes one round
verifies, from a calibration table's timings (`tables.py`, measured by `calibration.py`), fixed, or the fallback.

A round costs its verify forward and its commit, `T(N) = T_ver(N) + T_commit` for `N` draft nodes. The rule:

    0 (plain decoding: the roots alone, no drafting)   where T(floor) > (1 + epsilon) T(0)
    B_ver = max{N >= floor : T(N) <= (1 + epsilon) T(floor)}   otherwise

where the floor is one draft node a request, the least a round that drafts verifies. A draft node brings at most
one token; at a large batch, where the forward is compute-bound and even the floor's second column costs, a round
of the floor pays for itself only if its nodes are accepted more often than its cost grows, and epsilon is that
bar: the rule stops drafting once one node a request would cost more than `1 + epsilon` times a round of the roots
alone, and verifies more only while it costs at most `1 + epsilon` times the floor's round.

The forward of a batch runs every row at one width, finished rows too (as padding), so its cost follows the call's
batch size, not the rows still active: every round the budget is looked up at the call's batch size and at the
KV-length bucket at or below the longest active request's committed length (the smallest bucket when below all of
them), and each active row gets as many nodes as a row gets at the full batch (`BudgetResolver.__call__`). As rows
finish, the budget shrinks with them and no forward grows wider than its batch size's width in the table: the tree
state stays bounded by the batch size times that width, never by the batch size times the largest budget of a
table. KV bucket i covers the range up to the next one, which is optimistic (a longer context turns compute-bound a
little sooner), so put KV buckets where the budget changes fast.

A batch size between two of the table's batch buckets takes the timings on the line between theirs at equal nodes
per request (a forward's cost grows with its tokens); one outside them takes the nearest bucket's timings at equal
nodes per request, which past the largest bucket is optimistic (said once in a warning naming the command that
measures it).

Example:

```python
>>> from hf_bole.generation.budget import calibrate, BudgetResolver
>>> table = calibrate(model, batch_sizes=(1, 8, 64), kv_lengths=(1024,))  # minutes on a GPU
>>> table.save(table.default_path())
>>> resolver = BudgetResolver.from_table(table, epsilon=0.3, batch_size=8)
>>> resolver(active_rows=8, kv_length=1500), resolver(active_rows=2, kv_length=1500)
(120, 30)
```
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from fractions import Fraction

from hf_bole.config import AUTO_BUDGET, FALLBACK_BUDGET_MAX, FALLBACK_BUDGET_PER_REQUEST, BoleConfig
from hf_bole.generation.budget.tables import BudgetEntry, BudgetTable, TableKey, bucket_index, find_table, table_dirs
from hf_bole.generation.graphs import captures
from hf_bole.generation.select import row_width
from hf_bole.kernels.utils import MAX_TREE_NODES
from hf_bole.placement import placement

logger = logging.getLogger(__name__)
_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning(message)


def _say_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        logger.info(message)


def choose_budget(
    nodes: Sequence[int], t_ver: Sequence[float], t_commit: float, batch_size: int, epsilon: float
) -> int:
    """The budget of a round at `batch_size` requests (the module's rule): 0 (the roots alone) where one draft node a
    request costs a round more than `1 + epsilon` times the roots alone, else `B_ver = max{N >= batch_size :
    T(N) <= (1 + epsilon) T(batch_size)}` over the measured sizes, `T(N) = t_ver(N) + t_commit`.

    Every measured size counts, not only a prefix of them: when timings are not monotone in `N` (a wider forward
    that happens to tile better), a larger qualifying `N` wins over a smaller one that did not qualify. Without a
    timing at `N = 0` the rule never chooses plain decoding.

    Args:
        nodes (`Sequence[int]`): total draft nodes per forward, one per timing; `batch_size` (the floor) among them.
        t_ver (`Sequence[float]`): the verify forward's time at each of them.
        t_commit (`float`): a round's commit, in the unit of `t_ver`.
        batch_size (`int`): the requests of the forward.
        epsilon (`float`): the slack, >= 0.

    Returns:
        `int`: the budget.

    Example:

    ```python
    >>> # at 4 requests: the floor (4 nodes) costs 1.1 x the roots alone, 12 nodes 1.12 x the floor
    >>> choose_budget([0, 4, 12, 28], [1.0, 1.1, 1.232, 1.5], t_commit=0.0, batch_size=4, epsilon=0.2)
    12
    >>> choose_budget([0, 4, 12, 28], [1.0, 1.1, 1.232, 1.5], t_commit=0.0, batch_size=4, epsilon=0.05)
    0
    ```
    """
    if len(nodes) != len(t_ver):
        raise ValueError(f"{len(nodes)} node counts but {len(t_ver)} timings")
    if epsilon < 0:
        raise ValueError(f"epsilon must be >= 0, got {epsilon}")
    if batch_size not in nodes:
        raise ValueError(f"the timings hold no floor (N = batch size = {batch_size}) among the node counts {nodes}")
    rounds = dict(zip(nodes, (t + t_commit for t in t_ver)))
    floor = rounds[batch_size]
    if 0 in rounds and floor > (1 + epsilon) * rounds[0]:
        return 0
    return max(n for n, t in rounds.items() if n >= batch_size and t <= (1 + epsilon) * floor)


def entry_budget(entry: BudgetEntry, epsilon: float) -> int:
    """`choose_budget` over one table entry's timings: its budget at `epsilon` (the entry's `budget` field holds the
    one at the table's epsilon)."""
    return choose_budget(entry.nodes, entry.t_ver, entry.t_commit, entry.batch_size, epsilon)


def fallback_budget(batch_size: int) -> int:
    """The documented budget of `budget="auto"` without a table: `FALLBACK_BUDGET_PER_REQUEST` (31) draft nodes per
    request, at most `FALLBACK_BUDGET_MAX` (128) a round (`hf_bole.config`)."""
    return max(1, min(FALLBACK_BUDGET_PER_REQUEST * batch_size, FALLBACK_BUDGET_MAX))


def row_nodes(budget: int, batch_size: int) -> int:
    """The most draft nodes one row keeps in a round of `budget` nodes at `batch_size` rows: its verify width
    (`select.row_width`) less the root, and never more than the budget."""
    return min(budget, row_width(budget, batch_size, MAX_TREE_NODES) - 1)


class BudgetResolver:
    """The budget of every round of a call of `batch_size` rows: `resolver(active_rows, kv_length) -> int`, from a
    fixed number, a calibration table, or the fallback, each a budget at the full batch per KV-length bucket. Host-side
    only (a bisect look-up); `max_row_nodes` bounds every row's tree, so the decoding loop can size its buffers once.

    Build with `for_model` (what `generate` does), `from_table`, `fixed` or `fallback`.

    Args:
        kv_buckets (`Sequence[int]`): ascending KV lengths where the budget may change.
        budgets (`Sequence[int]`): the budget at the full batch from each of them on (the first below them too).
        batch_size (`int`): the call's rows.
        source (`str`): where the budgets come from, for log lines and reports.
    """

    def __init__(self, kv_buckets: Sequence[int], budgets: Sequence[int], batch_size: int, source: str):
        if len(kv_buckets) != len(budgets) or not budgets:
            raise ValueError(f"one budget per KV bucket, got {len(budgets)} for {list(kv_buckets)}")
        self.kv_buckets, self.budgets = list(kv_buckets), list(budgets)
        self.batch_size, self.source = batch_size, source
        self.max_row_nodes = max(row_nodes(n, batch_size) for n in budgets)

    def __call__(self, active_rows: int, kv_length: int) -> int:
        """The budget for a round with `active_rows` requests still decoding, the longest of which has committed
        `kv_length` tokens (left padding included): the full batch's, less the nodes of the rows that are done."""
        full = self.budgets[bucket_index(self.kv_buckets, kv_length)]
        return min(full, active_rows * row_nodes(full, self.batch_size))

    @property
    def drafts(self) -> bool:
        """Whether any round of the call verifies a draft (else every round decodes plainly: no drafter needed)."""
        return self.max_row_nodes > 0

    def __repr__(self) -> str:
        return f"BudgetResolver({self.source}, batch_size={self.batch_size}, max_row_nodes={self.max_row_nodes})"

    @classmethod
    def fixed(cls, budget: int, batch_size: int) -> BudgetResolver:
        return cls([0], [budget], batch_size, f"fixed {budget}")

    @classmethod
    def fallback(cls, batch_size: int) -> BudgetResolver:
        return cls([0], [fallback_budget(batch_size)], batch_size, "fallback")

    @classmethod
    def from_table(cls, table: BudgetTable, epsilon: float, batch_size: int) -> BudgetResolver:
        """The budgets of `table` at `epsilon` for a call of `batch_size` rows (`entries_at`)."""
        kv_buckets, entries = entries_at(table, batch_size)
        largest = max(e.batch_size for e in table.entries)
        if batch_size > largest:
            _warn_once(
                f"hf_bole: the verification budget table {table.key.filename} holds batch sizes up to {largest}; a "
                f"batch of {batch_size} takes its budget per request at {largest}, which a larger batch's more "
                f"compute-bound forward may not afford. Measure it with `python -m hf_bole.calibrate ... "
                f"--batch-sizes {batch_size}`."
            )
        budgets = [entry_budget(e, epsilon) for e in entries]
        return cls(kv_buckets, budgets, batch_size, f"table {table.key.filename} at epsilon {epsilon}")

    @classmethod
    def for_model(cls, model, config: BoleConfig, batch_size: int) -> BudgetResolver:
        """What `generate` uses for a call of `batch_size` rows: a fixed budget for an int `config.budget`; for
        `"auto"` the stored table of this model, device, dtype and verify mode at `config.epsilon`, or the fallback,
        said once in a log line."""
        if config.budget != AUTO_BUDGET:
            return cls.fixed(config.budget, batch_size)
        place = placement(model)
        device = place.input_device
        fallback = (
            f"budget={config.budget!r} uses the fallback of {FALLBACK_BUDGET_PER_REQUEST} draft nodes per "
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
            except ValueError as unreadable:  # an older format (its timings meant other forwards), or not a table
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
        # Built once per table version, epsilon and batch size: the interpolation costs host time in every call's
        # set-up. A table is read once per file version (`tables.find_table`).
        memo = (id(table), config.epsilon, batch_size)
        if memo not in _RESOLVERS:
            _RESOLVERS[memo] = (table, cls.from_table(table, config.epsilon, batch_size))
        return _RESOLVERS[memo][1]


# (id of a table, epsilon, batch size) -> (the table, its resolver, which no call changes); the table is held so that
# its id names no other while the entry lives
_RESOLVERS: dict[tuple[int, float, int], tuple[BudgetTable, BudgetResolver]] = {}


def _calibrate_command(model, key: TableKey, config: BoleConfig) -> str:
    """The `python -m hf_bole.calibrate` command that measures `key`'s table (for the log lines of a missing one)."""
    flags = " --no-cuda-graphs" if not key.replayed and captures(model, True) else ""
    # calibrate's --attention is "auto" too, which on a GPU is the kernel
    flags += " --compile" * config.compile + " --attention model" * ("triton-attention-" not in key.launch)
    return f"`python -m hf_bole.calibrate --model <checkpoint> --dtype {key.dtype} --verify {key.verify}{flags}`"


def entries_at(table: BudgetTable, batch_size: int) -> tuple[list[int], list[BudgetEntry]]:
    """The table's timings at `batch_size` requests: ascending KV lengths and, from each on, an entry of that batch
    size (the smallest KV length's below them too).

    At a batch bucket, its own entries, each batch bucket taking the KV bucket at or below the KV length (the
    smallest below all). Between two batch buckets, at every KV length where either's entry changes, the line
    between their timings (forward and commit) at equal draft nodes per request: those both measured, `N = x * lo`
    and `x * hi`, become `x * batch_size` (rounded down). Below the smallest batch bucket or above the largest, that
    bucket's timings at equal nodes per request."""
    if not table.entries:
        raise ValueError(f"the budget table for {table.key} has no entries")
    by_batch: dict[int, tuple[list[int], list[BudgetEntry]]] = {}  # batch bucket -> (kv buckets, entries)
    for entry in sorted(table.entries, key=lambda e: (e.batch_size, e.kv_length)):
        kvs, entries = by_batch.setdefault(entry.batch_size, ([], []))
        kvs.append(entry.kv_length)
        entries.append(entry)
    batch_buckets = sorted(by_batch)
    i = bucket_index(batch_buckets, batch_size)
    low = batch_buckets[i]
    if batch_size <= low or i + 1 == len(batch_buckets):
        kvs, entries = by_batch[low]
        return kvs, [_per_request(e, e, batch_size, 0.0, table.epsilon) for e in entries]
    high = batch_buckets[i + 1]
    kvs = sorted(set(by_batch[low][0]) | set(by_batch[high][0]))

    def at(bucket: int, kv: int) -> BudgetEntry:
        bucket_kvs, entries = by_batch[bucket]
        return entries[bucket_index(bucket_kvs, kv)]

    share = (batch_size - low) / (high - low)
    return kvs, [_per_request(at(low, kv), at(high, kv), batch_size, share, table.epsilon) for kv in kvs]


def _per_request(low: BudgetEntry, high: BudgetEntry, batch_size: int, share: float, epsilon: float) -> BudgetEntry:
    """The entry at `batch_size` requests `share` of the way from `low`'s timings to `high`'s, at the nodes per request
    both measured (`low` itself scaled to `batch_size` requests with `high = low`), its budget at `epsilon`."""
    at_low = {Fraction(n, low.batch_size): t for n, t in zip(low.nodes, low.t_ver)}
    at_high = {Fraction(n, high.batch_size): t for n, t in zip(high.nodes, high.t_ver)}
    both = sorted(at_low.keys() & at_high.keys())
    timings = {int(x * batch_size): at_low[x] + (at_high[x] - at_low[x]) * share for x in both}
    t_commit = low.t_commit + (high.t_commit - low.t_commit) * share
    nodes, t_ver = list(timings), list(timings.values())
    budget = choose_budget(nodes, t_ver, t_commit, batch_size, epsilon)
    return BudgetEntry(batch_size, low.kv_length, nodes, t_ver, t_commit, budget)
