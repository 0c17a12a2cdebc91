"""Calibration tables of the verification budget: what a table is keyed by, what it holds, and where it is stored and
found.

A table is keyed by the model's text config (`model_key`), the device name, the dtype, the verify mode and the
launch ("graphs" or "eager"), and holds one entry per (batch size, KV length) bucket with the raw timings, so a
different epsilon applies at look-up without measuring again. One JSON file per key (`TableKey.filename`); "auto"
reads the first it finds in `table_dirs()`: the user's `$HF_BOLE_CACHE/budgets/` (default
`~/.cache/hf_bole/budgets/`), where `python -m hf_bole.calibrate` writes, then the tables shipped in the package
(`hf_bole/budgets/`). The key holds the shape, not the weights, so a table measured on a random-weight model of a
published shape (`hf_bole.shapes`) serves that checkpoint.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import json
import os
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from hf_bole.config import resolve_attention
from hf_bole.generation.graphs import captures
from hf_bole.models.family import family_of
from hf_bole.placement import placement
from hf_bole.tensor_parallel import tensor_parallel

PACKAGE_TABLES = Path(__file__).resolve().parents[2] / "budgets"  # the tables shipped with hf_bole

# 2: keyed by how forwards launch (CUDA graphs or eager) too; 3: T_dec is the floor's forward; 4: replayed forwards
# timed at `row_width`'s bucket, no longer at the widest row's; 5: the floor verified at width 2 (was 4), the commit
# timed (`t_commit`), `t_dec` no longer stored (it is `t_ver` at the floor)
FORMAT_VERSION = 5
# Fields of a text config that set the cost of a forward; the model key hashes them.
_SHAPE_FIELDS = (
    "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "layer_types", "num_attention_heads",
    "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
    "linear_value_head_dim", "linear_conv_kernel_dim", "intermediate_size", "num_experts", "num_experts_per_tok",
    "moe_intermediate_size", "shared_expert_intermediate_size",
)  # fmt: skip
# Fields of KDA and MLA configs (Kimi-Linear, Bailing-Hybrid), hashed only where the config's class defines them, so
# that the keys of the GDN families' tables stay as they were.
_KDA_MLA_SHAPE_FIELDS = (
    "linear_num_heads", "linear_head_dim", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
    "v_head_dim",
)  # fmt: skip


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
    shape |= {name: getattr(config, name, None) for name in _KDA_MLA_SHAPE_FIELDS if name in defined}
    digest = hashlib.sha1(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()[:10]
    return f"{config.model_type}-h{config.hidden_size}-l{config.num_hidden_layers}-{digest}"


@functools.cache
def _defined_fields(config_class: type) -> frozenset[str]:
    """The shape fields a config class sets itself (on a default instance)."""
    default = config_class()
    return frozenset(name for name in _SHAPE_FIELDS + _KDA_MLA_SHAPE_FIELDS if hasattr(default, name))


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
    # for the torch.compile'd forward (`bole_compile`), "triton-attention-" for `bole_attention="triton"` and
    # "tp<N>-" for a model sharded over N ranks by tensor parallelism (each rank reads 1/N of the weights)
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
        attention = resolve_attention(attention, place.layer_devices[0], family_of(model.config).tree_attention_kernel)
        tp = tensor_parallel(model).size
        launch = f"tp{tp}-" * (tp > 1) + "compiled-" * compile + "triton-attention-" * (attention == "triton")
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
    """The timings of one (batch size, KV length) bucket, in milliseconds: the verify forward of `nodes[i]` draft
    nodes in all (`t_ver[i]`; 0 nodes: the roots alone; `batch_size` nodes: selection's floor, one a request) and the
    commit of a round (`t_commit`, the same for every tree: it reads and writes every row's state once). `budget` is
    `rule.choose_budget` at the table's epsilon; look-ups with another epsilon choose again from the timings
    (`rule.entry_budget`)."""

    batch_size: int
    kv_length: int
    nodes: list[int]
    t_ver: list[float]
    t_commit: float
    budget: int

    @property
    def t_floor(self) -> float:
        """The verify forward of selection's floor, one draft node a request."""
        return self.t_ver[self.nodes.index(self.batch_size)]


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


def bucket_index(buckets: Sequence[int], value: int) -> int:
    """The index of the largest bucket <= value, or 0 when value is below all (buckets sorted ascending)."""
    return max(bisect.bisect_right(buckets, value) - 1, 0)
