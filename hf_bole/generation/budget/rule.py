"""The verification budget's rule (DESIGN.md §5) and its look-up every round: how many draft nodes one verify forward
takes while it still costs about the least forward a round runs,

    B_ver = max{N : T_ver(N) <= (1 + epsilon) T_dec}

chosen from a calibration table's timings (`tables.py`, measured by `calibration.py`) at the round's number of active
requests and KV length, or fixed, or the fallback without a table. Look-up takes, in each batch bucket, the KV bucket
at or below the longest active request's committed length (the smallest bucket when below all of them): KV bucket i
covers the range up to the next one, which is optimistic (a longer context turns compute-bound a little sooner), so
put KV buckets where the budget changes fast. Between two batch buckets the budget follows the line between theirs,
by the number of active requests (outside them, the nearest bucket's): a batch shrinks as its rows finish, and the
budget can rise with the batch as well as fall. With budgets of 32, 64 and 384 nodes at 1, 4 and 8 requests, the
bucket at or below would verify 64 nodes for a batch of 8 once one row had finished and 32 once five had.

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

import logging
from collections.abc import Callable, Sequence

from hf_bole.config import AUTO_BUDGET, FALLBACK_BUDGET_MAX, FALLBACK_BUDGET_PER_REQUEST, BoleConfig
from hf_bole.generation.budget.tables import (
    BudgetEntry,
    BudgetTable,
    TableKey,
    bucket,
    bucket_index,
    find_table,
    table_dirs,
)
from hf_bole.generation.graphs import captures
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


def entry_budget(entry: BudgetEntry, epsilon: float) -> int:
    """`choose_budget` over one table entry's timings: its budget at `epsilon` (the entry's `budget` field holds the
    one at the table's epsilon)."""
    return choose_budget(entry.nodes, entry.t_ver, entry.t_dec, epsilon)


def fallback_budget(active_rows: int) -> int:
    """The documented budget of `budget="auto"` without a table: `FALLBACK_BUDGET_PER_REQUEST` (31) draft nodes per
    active request, at most `FALLBACK_BUDGET_MAX` (128) a round (`hf_bole.config`)."""
    return max(1, min(FALLBACK_BUDGET_PER_REQUEST * active_rows, FALLBACK_BUDGET_MAX))


class BudgetResolver:
    """The budget of every round: `resolver(active_rows, kv_length) -> int`, from a fixed number, a calibration
    table, or the fallback. Host-side only (dict and bisect look-ups); `max_budget` bounds every answer, so the
    decoding loop can size its buffers once.

    Build with `for_model` (what `generate` does), `from_table`, `fixed` or `fallback`.
    """

    def __init__(self, rule: Callable[[int, int], int], max_budget: int, source: str):
        self._rule, self.max_budget, self.source = rule, max_budget, source

    def __call__(self, active_rows: int, kv_length: int) -> int:
        """The budget for a round with `active_rows` requests still decoding, the longest of which has committed
        `kv_length` tokens (left padding included)."""
        return self._rule(active_rows, kv_length)

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
        max_budget = max(entry_budget(e, epsilon) for e in table.entries)
        return cls(rule, max_budget, f"table {table.key.filename} at epsilon {epsilon}")

    @classmethod
    def for_model(cls, model, config: BoleConfig, batch_size: int) -> BudgetResolver:
        """What `generate` uses: a fixed budget for an int `config.budget`; for `"auto"` the stored table of this
        model, device, dtype and verify mode at `config.epsilon`, or the fallback, said once in a log line."""
        if config.budget != AUTO_BUDGET:
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
        kvs, entries = by_batch[bucket(batch_buckets, active_rows)]
        return entries[bucket_index(kvs, kv_length)]

    return entry_for


def _interpolated_budget(table: BudgetTable, epsilon: float) -> Callable[[int, int], int]:
    """`(active_rows, kv_length) -> budget` under the epsilon rule: at a batch bucket, the budget of its entry at
    the KV bucket at or below `kv_length` (`_entry_lookup`); between two batch buckets, the line between their
    budgets at the active rows, rounded; below the smallest batch bucket or above the largest, that bucket's."""
    entry_for = _entry_lookup(table)
    chosen = {id(e): entry_budget(e, epsilon) for e in table.entries}
    batch_buckets = sorted({e.batch_size for e in table.entries})

    def at(batch_bucket: int, kv_length: int) -> int:
        return chosen[id(entry_for(batch_bucket, kv_length))]

    def budget(active_rows: int, kv_length: int) -> int:
        i = bucket_index(batch_buckets, active_rows)
        low = batch_buckets[i]
        if active_rows <= low or i + 1 == len(batch_buckets):
            return at(low, kv_length)
        high = batch_buckets[i + 1]
        below, above = at(low, kv_length), at(high, kv_length)
        return round(below + (above - below) * (active_rows - low) / (high - low))

    return budget
