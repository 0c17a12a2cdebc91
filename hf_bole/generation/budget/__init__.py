"""The verification budget (DESIGN.md §5): the rule and its look-up every round (`rule.py`), the calibration tables
and where they are stored (`tables.py`), and their measurement and plot (`calibration.py`; the command line is
`python -m hf_bole.calibrate`)."""

from hf_bole.generation.budget.calibration import (
    DEFAULT_BATCH_SIZES,
    DEFAULT_KV_LENGTHS,
    MAX_RATIO,
    calibrate,
    capacities,
    plot_table,
    synthetic_draft_tree,
)
from hf_bole.generation.budget.rule import (
    BudgetResolver,
    choose_budget,
    entries_at,
    entry_budget,
    fallback_budget,
    row_nodes,
)
from hf_bole.generation.budget.tables import (
    PACKAGE_TABLES,
    BudgetEntry,
    BudgetTable,
    TableKey,
    cache_dir,
    find_table,
    model_key,
    table_dirs,
)

__all__ = [
    "DEFAULT_BATCH_SIZES",
    "DEFAULT_KV_LENGTHS",
    "MAX_RATIO",
    "PACKAGE_TABLES",
    "BudgetEntry",
    "BudgetResolver",
    "BudgetTable",
    "TableKey",
    "cache_dir",
    "calibrate",
    "capacities",
    "choose_budget",
    "entries_at",
    "entry_budget",
    "fallback_budget",
    "find_table",
    "model_key",
    "plot_table",
    "row_nodes",
    "synthetic_draft_tree",
    "table_dirs",
]
