"""The verification budget: B_ver from timings, tables (keys, storage, look-up), "auto" in generate, the CLI."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen3_5Config

import hf_bole
from hf_bole.calibrate import main as calibrate_main
from hf_bole.config import BoleConfig
from hf_bole.generation import budget as budget_module
from hf_bole.generation import graphs as graphs_module
from hf_bole.generation import loop
from hf_bole.generation import select as select_module
from hf_bole.generation import verify as verify_module
from hf_bole.generation.budget import calibration as calibration_module
from hf_bole.generation.budget import rule as rule_module
from hf_bole.generation.budget import tables as tables_module
from hf_bole.generation.budget import (
    BudgetEntry,
    BudgetResolver,
    BudgetTable,
    TableKey,
    cache_dir,
    choose_budget,
    fallback_budget,
    find_table,
    model_key,
    synthetic_draft_tree,
)
from hf_bole.generation import select_nodes
from hf_bole.generation.select import prepared_tree
from hf_bole.placement import Placement
from hf_bole.tensor_parallel import TensorParallel
from hf_bole.models.twin import tree_twin
from tests.models import tiny

NODES = [0, 4, 12, 28]  # batch 4: the roots alone, the floor (width 2), widths 4 and 8


@pytest.fixture(autouse=True)
def budget_cache(tmp_path, monkeypatch):
    """Every test gets an empty table folder and an empty folder of shipped tables, and forgets the log lines
    already given."""
    monkeypatch.setenv("HF_BOLE_CACHE", str(tmp_path / "hf_bole_cache"))
    monkeypatch.setattr(tables_module, "PACKAGE_TABLES", tmp_path / "shipped")
    monkeypatch.setattr(rule_module, "_WARNED", set())
    return tmp_path / "hf_bole_cache" / "budgets"


@pytest.fixture(scope="module")
def dense():
    return tiny.build_model("dense")


@pytest.mark.parametrize(
    "t_ver, t_commit, epsilon, expected",
    [
        # rounds 1.0 | 1.05, 1.08, 1.12, 1.5 x the roots alone: against the floor 1.08 / 1.05, 1.12 / 1.05, ...
        pytest.param([1.0, 1.05, 1.1, 1.5], 0.0, 0.1, 12, id="monotone"),
        pytest.param([1.0, 1.05, 1.1, 1.5], 0.0, 0.5, 28, id="large-epsilon-takes-all"),
        pytest.param([1.0, 1.0, 1.0, 1.01], 0.0, 0.0, 12, id="epsilon-0-equality-counts"),
        pytest.param([1.0, 1.0, 1.1, 1.2], 0.0, 0.1, 12, id="boundary-inclusive"),
        # the floor costs 1.3 x the roots alone: one node a request would need to be accepted 30% of the time
        pytest.param([1.0, 1.3, 1.35, 1.6], 0.0, 0.25, 0, id="plain-decoding"),
        pytest.param([1.0, 1.3, 1.35, 1.6], 0.0, 0.3, 28, id="floor-just-pays"),
        # a commit as long as the roots' forward halves the floor's extra cost: the rounds 2.0 and 2.3
        pytest.param([1.0, 1.3, 1.35, 1.6], 1.0, 0.15, 28, id="commit-counts"),
        # 12 is over the limit but 28 is under (it tiles better): the largest qualifying N wins
        pytest.param([1.0, 1.0, 1.2, 1.05], 0.0, 0.1, 28, id="non-monotone"),
    ],
)
def test_choose_budget(t_ver, t_commit, epsilon, expected):
    assert choose_budget(NODES, t_ver, t_commit, 4, epsilon) == expected
    # scale-free: milliseconds or seconds give the same choice
    assert choose_budget(NODES, [7.5 * t for t in t_ver], 7.5 * t_commit, 4, epsilon) == expected


def test_choose_budget_without_the_roots_alone_always_drafts():
    """A table without `N = 0` (a grid given without it) never chooses plain decoding: it cannot tell."""
    assert choose_budget(NODES[1:], [5.0, 5.1, 9.0], 0.0, 4, 0.1) == 12


def test_choose_budget_rejects():
    with pytest.raises(ValueError, match="epsilon must be >= 0"):
        choose_budget(NODES, [1.0] * 4, 0.0, 4, -0.1)
    with pytest.raises(ValueError, match="4 node counts but 3 timings"):
        choose_budget(NODES, [1.0] * 3, 0.0, 4, 0.1)
    with pytest.raises(ValueError, match=r"no floor \(N = batch size = 8\)"):
        choose_budget(NODES, [1.0] * 4, 0.0, 8, 0.1)


def _entry(b: int, kv: int, ratios: list[float], nodes: list[int] | None = None, t_commit=0.0, scale=2.0):
    """An entry of forwards `scale * ratios` at `nodes` (default: the roots alone, then widths 2, 4, 8, 16)."""
    nodes = nodes or [0] + [b * (w - 1) for w in (2, 4, 8, 16)][: len(ratios) - 1]
    t_ver = [scale * r for r in ratios]
    return BudgetEntry(b, kv, nodes, t_ver, t_commit, choose_budget(nodes, t_ver, t_commit, b, 0.1))


def _table(key: TableKey | None = None) -> BudgetTable:
    """Batch buckets 1 and 4, KV buckets 512 and 2048; ratios chosen so each bucket picks a different budget."""
    entries = [
        _entry(1, 512, [1.0, 1.02, 1.05, 1.1, 1.3]),  # eps 0.1: 7 (width 8); eps 0.3: 15
        _entry(1, 2048, [1.0, 1.05, 1.2, 1.4, 1.6]),  # 1; 3
        _entry(4, 512, [1.0, 1.08, 1.12, 1.5, 2.0]),  # 12; 12
        _entry(4, 2048, [1.0, 1.2, 1.3, 1.7, 2.4]),  # 0 (the floor 1.2 x the roots alone); 12
    ]
    key = key or TableKey("qwen3_5_text-h64-l4-0123456789", "NVIDIA H200", "bfloat16", "closed_form", "graphs")
    return BudgetTable(key, 0.1, entries, meta={"topk": 4})


@pytest.mark.parametrize(
    "batch, active, kv, epsilon, expected",
    [
        pytest.param(1, 1, 512, 0.1, 7, id="exact-bucket"),
        pytest.param(1, 1, 2047, 0.1, 7, id="kv-rounds-down"),
        pytest.param(1, 1, 100, 0.1, 7, id="kv-below-all"),
        pytest.param(1, 1, 10**6, 0.1, 1, id="kv-above-all"),
        pytest.param(4, 4, 512, 0.1, 12, id="batch-bucket"),
        pytest.param(4, 4, 2048, 0.1, 0, id="plain-decoding"),
        pytest.param(1, 1, 512, 0.3, 15, id="epsilon-chooses-again"),
        pytest.param(4, 4, 2048, 0.3, 12, id="epsilon-chooses-again-large-batch"),
        # rows finish: each active row keeps the 3 nodes a row gets at the batch of 4, never the 1-row budget
        pytest.param(4, 1, 512, 0.1, 3, id="one-row-left"),
        pytest.param(4, 3, 512, 0.3, 9, id="three-rows-left"),
    ],
)
def test_resolver_looks_up_buckets(batch, active, kv, epsilon, expected):
    resolver = BudgetResolver.from_table(_table(), epsilon, batch)
    assert resolver(active, kv) == expected


def test_resolver_sizes_for_the_widest_row_of_its_batch():
    """`max_row_nodes`: the most draft nodes one row of a call gets at any KV length, what the loop sizes the drafter's
    trees and the cache's spare slots for; 0 where every round decodes plainly (no drafter is made)."""
    table = _table()
    assert BudgetResolver.from_table(table, 0.1, 1).max_row_nodes == 7
    assert BudgetResolver.from_table(table, 0.1, 4).max_row_nodes == 3  # width 4 at KV 512, plain at 2048
    assert BudgetResolver.from_table(table, 0.1, 4).drafts
    plain = BudgetTable(table.key, 0.1, [_entry(4, 512, [1.0, 1.5, 2.0])])
    resolver = BudgetResolver.from_table(plain, 0.1, 4)
    assert resolver.max_row_nodes == 0 and not resolver.drafts and resolver(4, 512) == 0


def test_budget_never_widens_a_call_as_its_rows_finish():
    """The forward of a batch runs every row at one width, finished ones too: a call of 8 rows whose rows finish one
    by one keeps its width (15 nodes a row at 120 nodes), while a table looked up at the active rows would give the
    last row 63 nodes, a forward of 8 x 64 tokens and as much tree state, the batch times the largest budget."""
    nodes = {1: [0, 1, 3, 7, 15, 31, 63], 8: [0, 8, 24, 56, 120, 248, 504]}
    ratios = {1: [1.0, 1.0, 1.0, 1.01, 1.02, 1.04, 1.08], 8: [1.0, 1.0, 1.0, 1.1, 1.2, 1.5, 2.3]}
    entries = [_entry(b, 1024, ratios[b], nodes[b]) for b in (1, 8)]
    table = BudgetTable(TableKey("m", "NVIDIA H200", "bfloat16", "closed_form", "graphs"), 0.3, entries)
    resolver = BudgetResolver.from_table(table, epsilon=0.3, batch_size=8)
    assert [resolver(rows, 1024) for rows in range(8, 0, -1)] == [120, 105, 90, 75, 60, 45, 30, 15]
    assert resolver.max_row_nodes == 15
    assert max(select_module.row_width(resolver(r, 1024), r, 16) for r in range(1, 9)) == 16
    assert BudgetResolver.from_table(table, epsilon=0.3, batch_size=1)(1, 1024) == 63  # a call of one row


def test_batch_sizes_between_buckets_take_the_timings_between():
    """Batch 160 between buckets 64 and 256: each width's forward on the line between theirs (per request), the
    commit too, and the rule applied to those: plain decoding at 256, a chain of one at 64, and at 160 the floor's
    round 21 / 16.5 = 1.27 x the roots'."""
    entries = [
        _entry(64, 1024, [1.0, 1.1, 1.5], t_commit=0.5, scale=10.0),  # rounds 10.5 | 11.5, 15.5
        _entry(256, 1024, [1.0, 1.4, 2.2], t_commit=2.5, scale=20.0),  # rounds 22.5 | 30.5, 46.5
    ]
    table = BudgetTable(TableKey("m", "NVIDIA H100", "bfloat16", "closed_form", "graphs"), 0.3, entries)
    (kv,), (entry,) = budget_module.entries_at(table, 160)
    assert kv == 1024 and entry.batch_size == 160 and entry.nodes == [0, 160, 480]
    torch.testing.assert_close(entry.t_ver, [15.0, 19.5, 29.5])  # halfway: (10 + 20) / 2, (11 + 28) / 2, ...
    assert entry.t_commit == 1.5
    budgets = {b: BudgetResolver.from_table(table, 0.3, b)(b, 1024) for b in (64, 160, 256)}
    assert budgets == {64: 64, 160: 160, 256: 0}
    budgets = {b: BudgetResolver.from_table(table, 0.25, b)(b, 1024) for b in (64, 160, 256)}
    assert budgets == {64: 64, 160: 0, 256: 0}


def test_batch_sizes_outside_the_table_take_the_nearest_buckets_per_request(caplog):
    """Below the smallest bucket its timings per request (a smaller batch is no more compute-bound); past the largest
    too, said once in a warning, since a larger batch may not afford them."""
    entries = [_entry(4, 1024, [1.0, 1.0, 1.1, 1.2]), _entry(8, 1024, [1.0, 1.05, 1.2, 1.6])]
    table = BudgetTable(TableKey("m", "NVIDIA H100", "bfloat16", "closed_form", "graphs"), 0.1, entries)
    (_,), (small,) = budget_module.entries_at(table, 2)
    assert small.nodes == [0, 2, 6, 14] and small.t_ver == entries[0].t_ver
    assert BudgetResolver.from_table(table, 0.1, 2)(2, 1024) == 6
    with caplog.at_level(logging.WARNING, logger="hf_bole.generation.budget"):
        for _ in range(2):
            resolver = BudgetResolver.from_table(table, 0.1, 32)
    assert resolver(32, 1024) == 32 * 1
    (message,) = [r.getMessage() for r in caplog.records]
    assert "holds batch sizes up to 8; a batch of 32" in message and "--batch-sizes 32" in message


def test_resolver_fixed_and_fallback(dense):
    fixed = BudgetResolver.for_model(dense, BoleConfig(budget=7), batch_size=4)
    assert fixed(4, 100) == 7 and fixed(1, 100) == 3  # width 4 at 4 rows: 3 nodes a row
    assert BudgetResolver.for_model(dense, BoleConfig(budget=64), batch_size=1)(1, 100) == 64
    assert BudgetResolver.for_model(dense, BoleConfig(budget=0), batch_size=4).max_row_nodes == 0
    fallback = BudgetResolver.fallback(batch_size=8)
    assert [fallback(a, 10) for a in (8, 4, 2, 1)] == [128, 124, 62, 31]  # 128 over 8 rows: width 32
    assert fallback.max_row_nodes == 31 and fallback_budget(8) == 128
    assert fallback_budget(1) == BudgetResolver.fallback(batch_size=1).max_row_nodes == 31
    # one request's fallback tree fills the verify width of 32 with its root, the widest at the GDN solve's least tile
    assert select_module.row_width(fallback_budget(1), 1, fallback_budget(1) + 1) == 32


def test_table_round_trip(budget_cache):
    table = _table()
    path = table.save(table.default_path())
    assert path == budget_cache / "qwen3_5_text-h64-l4-0123456789__NVIDIA-H200__bfloat16__closed_form__graphs.json"
    assert cache_dir() == budget_cache
    data = json.loads(path.read_text())
    assert data["format"] == 5 and data["epsilon"] == 0.1 and data["meta"] == {"topk": 4}
    key = {"model": table.key.model, "device": "NVIDIA H200", "dtype": "bfloat16", "verify": "closed_form",
           "launch": "graphs"}  # fmt: skip
    assert data["key"] == key
    assert data["entries"][0] == {"batch_size": 1, "kv_length": 512, "nodes": [0, 1, 3, 7, 15],
                                  "t_ver": [2.0, 2.04, 2.1, 2.2, 2.6], "t_commit": 0.0, "budget": 7}  # fmt: skip
    assert BudgetTable.load(path) == table
    assert find_table(table.key) == table
    assert find_table(TableKey(table.key.model, "NVIDIA H100", "bfloat16", "closed_form", "graphs")) is None
    assert find_table(TableKey(table.key.model, "NVIDIA H200", "bfloat16", "serial", "graphs")) is None
    assert find_table(TableKey(table.key.model, "NVIDIA H200", "bfloat16", "closed_form", "eager")) is None
    data["format"] = 0
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="format 0 is not 5: calibrate again"):
        find_table(table.key)  # a rewritten file is read again


def test_model_key():
    key = model_key(tiny.text_config())
    assert key.startswith("qwen3_5_text-h64-l4-")
    assert model_key(tiny.text_config()) == key  # stable
    # the text config of a composite (vision-language) config is what counts
    composite = Qwen3_5Config(text_config=tiny.text_config().to_dict(), vision_config={"depth": 1})
    assert model_key(composite) == key
    assert model_key(tiny.text_config(hidden_size=96)) != key
    assert model_key(tiny.text_config(num_key_value_heads=2)) != key
    assert model_key(tiny.text_config("moe")).startswith("qwen3_5_moe_text-h64-l4-")


# The text config of Qwen/Qwen3.5-9B's config.json (a Qwen3_5ForConditionalGeneration checkpoint): fields that set a
# forward's cost beside ones that do not (rope details, gates, dtypes).
PUBLISHED_9B_TEXT = {
    "model_type": "qwen3_5_text", "attention_bias": False, "attn_output_gate": True, "eos_token_id": 248044,
    "full_attention_interval": 4, "head_dim": 256, "hidden_size": 4096, "intermediate_size": 12288,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 8, "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_value_head_dim": 128, "num_attention_heads": 16, "num_key_value_heads": 4, "num_hidden_layers": 32,
    "rms_norm_eps": 1e-06, "vocab_size": 248320, "mamba_ssm_dtype": "float32", "mtp_num_hidden_layers": 1,
    "mtp_use_dedicated_embeddings": False, "tie_word_embeddings": False, "dtype": "bfloat16",
    "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "rope_type": "default",
                        "rope_theta": 10000000, "partial_rotary_factor": 0.25},
}  # fmt: skip
VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 32, "num_heads": 2}
# The 9B shape shrunk to a tiny model of the same structure.
SMALL_9B = dict(vocab_size=101, hidden_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                linear_value_head_dim=16, intermediate_size=96)  # fmt: skip


def test_model_key_of_published_checkpoints_is_their_shapes(tmp_path):
    """A table measured on a random-weight shape (`python -m hf_bole.calibrate --shape 9B`) serves the published
    checkpoint: its config.json wraps the text config in a vision-language one and carries fields that cost nothing.
    A mixture-of-experts config may carry `intermediate_size`, which its class does not define: it counts as unset."""
    from transformers import AutoConfig

    from hf_bole.shapes import shape_config

    checkpoint = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
                  "text_config": PUBLISHED_9B_TEXT, "vision_config": {**VISION, "out_hidden_size": 4096}}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(checkpoint))
    assert model_key(AutoConfig.from_pretrained(tmp_path)) == model_key(shape_config("9B"))
    assert model_key(shape_config(str(tmp_path))) == model_key(shape_config("9B"))  # calibrate --shape <folder>
    moe = shape_config("35B-A3B")
    text = {**moe.to_dict(), "intermediate_size": 5632, "attn_output_gate": True}
    composite = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
                 "text_config": text, "vision_config": {**VISION, "out_hidden_size": 2048}}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(composite))
    assert model_key(AutoConfig.from_pretrained(tmp_path)) == model_key(moe)


def test_table_key_of_a_conditional_generation_checkpoint(tmp_path):
    """The real Qwen3.5 checkpoints are Qwen3_5ForConditionalGeneration: loaded either way (as users load them, through
    AutoModelForCausalLM or as that class), the key is that of a random Qwen3_5ForCausalLM of the same text config."""
    from transformers import AutoModelForCausalLM, Qwen3_5ForConditionalGeneration

    from hf_bole.shapes import build_model, shape_config

    random_shape = build_model(shape_config("9B", **SMALL_9B), "cpu", torch.float32)
    vision = {**VISION, "out_hidden_size": 64}
    composite = Qwen3_5Config(text_config=shape_config("9B", **SMALL_9B).to_dict(), vision_config=vision)
    Qwen3_5ForConditionalGeneration(composite).save_pretrained(tmp_path)
    key = TableKey.for_model(random_shape)
    for loader in (AutoModelForCausalLM, Qwen3_5ForConditionalGeneration):
        loaded = loader.from_pretrained(tmp_path, dtype=torch.float32, device_map="cpu")  # where random_shape is
        assert TableKey.for_model(loaded) == key, loader.__name__


def _fake_gpu_model(monkeypatch):
    monkeypatch.setattr(tables_module, "device_name", lambda device: "NVIDIA Test GPU")
    gpu = torch.device("cuda", 0)
    one_gpu = lambda model: Placement(gpu, gpu, (gpu,) * 4)  # noqa: E731
    monkeypatch.setattr(tables_module, "placement", one_gpu)
    monkeypatch.setattr(rule_module, "placement", one_gpu)
    monkeypatch.setattr(graphs_module, "placement", one_gpu)
    return _FakeModel(
        device=torch.device("cuda"), dtype=torch.bfloat16, config=tiny.text_config(), named_modules=lambda: iter(()),
        parameters=lambda: iter(()),
    )


class _FakeModel(SimpleNamespace):
    """A model's attributes without its weights, keyed by identity as modules are: hf_bole keeps per-model facts in
    weak dictionaries."""

    __hash__ = object.__hash__


def test_tensor_parallel_table_key(monkeypatch):
    """A model sharded over two ranks reads 1/2 of the weights per forward and runs it eager: a table of its own."""
    model = _fake_gpu_model(monkeypatch)
    sharded = lambda model: TensorParallel(2, None, 1)  # noqa: E731
    monkeypatch.setattr(tables_module, "tensor_parallel", sharded)
    monkeypatch.setattr(graphs_module, "tensor_parallel", sharded)
    key = TableKey.for_model(model, cuda_graphs=True)
    assert key.launch == "tp2-triton-attention-eager" and key.filename.endswith("__tp2-triton-attention-eager.json")


def test_auto_without_table_warns_once(monkeypatch, caplog):
    model = _fake_gpu_model(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="hf_bole.generation.budget"):
        resolvers = [BudgetResolver.for_model(model, BoleConfig(), batch_size=4) for _ in range(3)]
    assert len(caplog.records) == 1  # once, however often generate is called
    message = caplog.records[0].getMessage()
    assert "no verification budget table" in message and "NVIDIA Test GPU" in message
    # on a GPU the default attention ("auto") is the tree attention kernel's, whose forwards get a table of their own
    assert "NVIDIA-Test-GPU__bfloat16__closed_form__triton-attention-graphs.json" in message
    assert "python -m hf_bole.calibrate --model <checkpoint> --dtype bfloat16 --verify closed_form`" in message
    assert "31 draft nodes per request, at most 128" in message
    for resolver in resolvers:
        assert resolver.source == "fallback" and resolver(2, 1000) == 62 and resolver.max_row_nodes == 31
    # another verify mode is another table, hence another warning
    with caplog.at_level(logging.WARNING, logger="hf_bole.generation.budget"):
        BudgetResolver.for_model(model, BoleConfig(verify="serial"), batch_size=4)
    assert len(caplog.records) == 2 and "serial__triton-attention-graphs.json" in caplog.records[1].getMessage()
    # forwards launched from Python (bole_cuda_graphs=False) cost differently: a table of their own
    with caplog.at_level(logging.WARNING, logger="hf_bole.generation.budget"):
        BudgetResolver.for_model(model, BoleConfig(cuda_graphs=False), batch_size=4)
    message = caplog.records[2].getMessage()
    assert "closed_form__triton-attention-eager.json" in message and "--verify closed_form --no-cuda-graphs`" in message
    # so does the compiled forward (bole_compile=True)
    with caplog.at_level(logging.WARNING, logger="hf_bole.generation.budget"):
        BudgetResolver.for_model(model, BoleConfig(compile=True), batch_size=4)
    message = caplog.records[3].getMessage()
    assert "closed_form__compiled-triton-attention-graphs.json" in message
    assert "--verify closed_form --compile`" in message
    # and the model's own attention (bole_attention="model")
    with caplog.at_level(logging.WARNING, logger="hf_bole.generation.budget"):
        BudgetResolver.for_model(model, BoleConfig(compile=True, attention="model"), batch_size=4)
    message = caplog.records[4].getMessage()
    assert "closed_form__compiled-graphs.json" in message
    assert "--verify closed_form --compile --attention model`" in message


def test_auto_for_a_spread_model_is_the_fallback(monkeypatch, caplog):
    """A model over two GPUs takes no table (calibration times one GPU's forwards), even one stored for its GPU, and
    the log line does not send its user to calibrate."""
    model = _fake_gpu_model(monkeypatch)
    table = _table(TableKey.for_model(model, cuda_graphs=False))  # the eager table of its GPU, were it on one
    table.save(table.default_path())
    gpus = [torch.device("cuda", 0), torch.device("cuda", 1)]
    spread = Placement(gpus[0], gpus[1], (gpus[0], gpus[0], gpus[1], gpus[1]))
    monkeypatch.setattr(rule_module, "placement", lambda model: spread)
    monkeypatch.setattr(tables_module, "placement", lambda model: spread)
    with caplog.at_level(logging.WARNING, logger="hf_bole.generation.budget"):
        resolver = BudgetResolver.for_model(model, BoleConfig(cuda_graphs=False), batch_size=4)
    assert resolver.source == "fallback" and resolver(2, 1000) == 62
    message = caplog.records[-1].getMessage()
    assert "spread over 2 devices" in message and "pass bole_budget=<int>" in message and "hf_bole.calibrate" not in message


def test_auto_finds_stored_table(monkeypatch, caplog):
    model = _fake_gpu_model(monkeypatch)
    key = TableKey.for_model(model)
    launch = "triton-attention-graphs"  # on a GPU the default ("auto") attention is the kernel
    assert key == TableKey(model_key(model.config), "NVIDIA Test GPU", "bfloat16", "closed_form", launch)
    assert TableKey.for_model(model, cuda_graphs=False).launch == "triton-attention-eager"
    assert TableKey.for_model(model, compile=True).launch == "compiled-triton-attention-graphs"
    assert TableKey.for_model(model, attention="model").launch == "graphs"
    assert TableKey.for_model(model, attention="triton") == key
    _table(key).save(_table(key).default_path())
    with caplog.at_level(logging.INFO, logger="hf_bole.generation.budget"):
        resolver = BudgetResolver.for_model(model, BoleConfig(epsilon=0.3), batch_size=4)
        assert BudgetResolver.for_model(model, BoleConfig(epsilon=0.3), batch_size=4) is resolver  # built once
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, f"hf_bole: budget='auto' reads the verification budget table {_table(key).default_path()}")
    ]  # once
    assert resolver(4, 512) == 12 and resolver(4, 4096) == 12  # chosen again at epsilon 0.3 (at 0.1: 0 at KV 4096)
    assert resolver(1, 512) == 3  # one row left of four: the 3 nodes a row gets at the batch of 4
    assert BudgetResolver.for_model(model, BoleConfig(epsilon=0.1), batch_size=4)(4, 4096) == 0  # another epsilon
    # a table measured again (another file version) is read again, and so are its budgets
    again = _table(key)
    again.entries = [replace(e, t_ver=[1.0, 1.0, 1.0, 1.0, 1.0]) for e in again.entries]
    path = again.save(again.default_path())
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    assert BudgetResolver.for_model(model, BoleConfig(epsilon=0.3), batch_size=4)(4, 512) == 60  # width 16: flat times


def test_auto_finds_a_shipped_table_after_the_users(monkeypatch, caplog):
    """The tables shipped in the package (hf_bole/budgets/) are read when the user's cache folder holds none for the
    key; one in the cache folder (the user's own calibration) comes first. The log line says which file is read."""
    model = _fake_gpu_model(monkeypatch)
    key = TableKey.for_model(model)
    shipped_path = _table(key).save(tables_module.PACKAGE_TABLES / key.filename)  # at epsilon 0.3: 15 at batch 1
    with caplog.at_level(logging.INFO, logger="hf_bole.generation.budget"):
        resolver = BudgetResolver.for_model(model, BoleConfig(epsilon=0.3), batch_size=1)
    assert str(shipped_path) in caplog.records[-1].getMessage() and resolver(1, 512) == 15
    own = _table(key)
    own.entries[0].t_ver[-1] = 9.0  # and 7 in the user's
    own_path = own.save(own.default_path())
    with caplog.at_level(logging.INFO, logger="hf_bole.generation.budget"):
        resolver = BudgetResolver.for_model(model, BoleConfig(epsilon=0.3), batch_size=1)
    assert str(own_path) in caplog.records[-1].getMessage() and resolver(1, 512) == 7


def test_shipped_tables_are_current():
    """Every table shipped in the package is one this version reads (`eval/gpu.sh cal-*` measures them again after a
    change of format), of a published shape or the house model, in bf16, its batch sizes the default ones from 1 up
    to where its calibration stopped (a larger shape's largest batches may not fit in memory; batches past a table's
    largest are looked up per request from it)."""
    from hf_bole.shapes import SHAPES, available, shape_config

    from eval.shapes import shape_config as eval_shape_config

    known = {model_key(shape_config(name)) for name in SHAPES if available(name)}
    known |= {model_key(eval_shape_config("house"))}
    folder = tables_module.Path(tables_module.__file__).resolve().parents[2] / "budgets"
    tables = [BudgetTable.load(path) for path in sorted(folder.glob("*.json"))]
    assert tables
    for table in tables:
        assert table.key.model in known and table.key.dtype == "bfloat16", table.key.filename
        batch_sizes = sorted({e.batch_size for e in table.entries})
        assert batch_sizes == list(budget_module.DEFAULT_BATCH_SIZES[: len(batch_sizes)]), table.key.filename
    # the 9B shape's on an H100, every default batch size (`eval/gpu.sh cal-9B`)
    nine_b = [t for t in tables if t.key.model == model_key(shape_config("9B")) and "H100" in t.key.device]
    assert [sorted({e.batch_size for e in t.entries}) for t in nine_b] == [list(budget_module.DEFAULT_BATCH_SIZES)]


def test_auto_with_an_older_table_warns_and_falls_back(monkeypatch, caplog):
    """A table of format 4 timed the floor at width 4 and no commit, which generate no longer runs (the floor runs at
    width 2): generate does not read it, says which file, why, and how to measure it again."""
    model = _fake_gpu_model(monkeypatch)
    table = _table(TableKey.for_model(model))
    path = table.save(table.default_path())
    data = json.loads(path.read_text())
    data["format"] = 4
    path.write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING, logger="hf_bole.generation.budget"):
        resolver = BudgetResolver.for_model(model, BoleConfig(), batch_size=4)
    assert resolver.source == "fallback" and resolver(2, 1000) == 62
    message = caplog.records[0].getMessage()
    assert str(path) in message and "format 4 is not 5" in message
    assert "Measure it again with `python -m hf_bole.calibrate --model <checkpoint>" in message
    # a usable table shipped with the package is then read
    table.save(tables_module.PACKAGE_TABLES / path.name)
    assert BudgetResolver.for_model(model, BoleConfig(), batch_size=4).source.startswith("table ")


def test_auto_on_cpu_uses_fallback(caplog):
    model = tiny.build_model("dense").to("cpu")  # also when the tests run on a GPU
    with caplog.at_level(logging.WARNING, logger="hf_bole.generation.budget"):
        for _ in range(2):
            resolver = BudgetResolver.for_model(model, BoleConfig(), batch_size=2)
    expected = (
        "hf_bole: no calibrated verification budget on cpu: budget='auto' uses the fallback of 31 draft nodes per "
        "request, at most 128 per round (pass bole_budget=<int> to fix it)"
    )
    assert [r.getMessage() for r in caplog.records] == [expected]
    assert resolver.source == "fallback" and resolver(1, 10) == 31


def _record_rounds(monkeypatch) -> list[tuple[int, int]]:
    """(budget, kept draft nodes) of every round `generate` selects (without CUDA graphs: a replayed selection
    calls no Python)."""
    rounds = []

    def select_round(tree, root_tokens, budget, max_nodes_per_row, active=None, safe=None):
        vt = select_nodes(prepared_tree(tree, active, safe), root_tokens, budget, max_nodes_per_row)
        rounds.append((budget, int(vt.num_nodes.sum()) - len(root_tokens)))
        return vt

    monkeypatch.setattr(loop, "select_round", select_round)
    return rounds


def _generate(model, prompts, **kwargs):
    ids, mask = tiny.left_pad(prompts)
    return model.generate(ids, attention_mask=mask, pad_token_id=0, max_new_tokens=12, do_sample=False, **kwargs)


PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [3, 4, 3, 4, 3, 4]]


def test_generate_auto_matches_plain(dense, monkeypatch):
    ref = _generate(dense, PROMPTS)
    rounds = _record_rounds(monkeypatch)
    out = _generate(dense, PROMPTS, custom_generate="hf_bole", bole_drafter="ngram", bole_cuda_graphs=False)
    assert torch.equal(out, ref)  # budget "auto" by default, without a table: the fallback
    assert rounds and all(budget == fallback_budget(2) for budget, _ in rounds)


def test_generate_auto_looks_up_every_round(dense, monkeypatch):
    """The loop asks the resolver every round with the active rows and the longest committed length."""
    calls = []

    class Recording(BudgetResolver):
        def __call__(self, active_rows, kv_length):
            calls.append((active_rows, kv_length))
            return 1 + len(calls) % 3  # 2, 3, 1, 2, ...: changes every round

    monkeypatch.setattr(BudgetResolver, "for_model", classmethod(lambda cls, *a: Recording([0], [3], 2, "test")))
    rounds = _record_rounds(monkeypatch)
    ref = _generate(dense, PROMPTS)
    out = _generate(
        dense, PROMPTS, custom_generate="hf_bole", bole_drafter="ngram", bole_cuda_graphs=False,
        return_dict_in_generate=True,
    )  # fmt: skip
    assert torch.equal(out.sequences, ref)
    P = len(PROMPTS[0])  # left padding included
    assert calls[0] == (2, P)  # after the prefill: the prompt is committed, the first token is the root
    # tokens per row before each round: the prefill's one, then what the rounds emitted, up to max_new_tokens
    n_gen = (1 + torch.cat([torch.zeros(2, 1, dtype=torch.long), out.accept_lengths], 1).cumsum(1)).clamp(max=12)
    active = n_gen < 12
    expected = [(int(a.sum()), P - 1 + int(n[a].max())) for n, a in zip(n_gen.T, active.T) if a.any()]
    assert calls == expected
    assert [budget for budget, _ in rounds] == [1 + i % 3 for i in range(1, len(calls) + 1)]
    assert all(kept <= max(budget, 2) for budget, kept in rounds)  # the floor keeps one root child per row


def test_synthetic_draft_tree():
    g = torch.Generator().manual_seed(0)
    tree = synthetic_draft_tree(3, topk=4, depth=5, generator=g)
    tree.validate(batch_size=3)
    assert tree.tokens.shape == (3, 4 + 4 * 16)  # topk + (depth - 1) * topk^2, as the MTP drafter
    assert tree.depths().amax(-1).tolist() == [4, 4, 4]
    # level 2 hangs below the 4 best root children, 4 children each
    assert sorted(set(tree.parents[0, 4:20].tolist())) == [0, 1, 2, 3]


def test_calibrate_times_the_width_generate_runs(dense, monkeypatch):
    """Selection pads every row to the most one row could get; the timed forward is as wide as the widest row
    kept, as in the decoding loop (at batch 4 a budget of 8 leaves each row a few nodes, not 8); a round's commit is
    timed on a forward of the roots alone."""
    widths, commits = [], []
    forward = verify_module.tree_forward
    def recorded(model, cache, ids, *args, **kwargs):
        widths.append(ids.shape[1])
        return forward(model, cache, ids, *args, **kwargs)

    monkeypatch.setattr(verify_module, "tree_forward", recorded)
    commit = hf_bole.BoleCache.commit
    recorded = lambda self, r, path, **k: commits.append(path.shape) or commit(self, r, path, **k)  # noqa: E731
    monkeypatch.setattr(hf_bole.BoleCache, "commit", recorded)
    table = budget_module.calibrate(
        dense, [4], [8], [0, 8], warmup=1, reps=2, progress=False, cuda_graphs=False, attention="model"
    )  # fmt: skip
    assert table.key.launch == "eager" and table.meta["launched"] == "from Python"
    assert widths[:3] == [1, 1, 1]  # roots only, warm-up and timed calls
    assert widths[3:6] == [2, 2, 2]  # the floor (N = 4): each row's best root child
    assert widths[6] == 1 and commits == [(4, 1)] * 3  # the commits' forward, then a token a commit
    assert 2 <= max(widths[7:]) < 1 + 8
    (entry,) = table.entries
    assert entry.nodes == [0, 4, 8] and entry.t_floor == entry.t_ver[1] and entry.t_commit > 0


def test_calibrate_stops_past_max_ratio(dense, monkeypatch):
    """A bucket's sweep stops at the first size whose forward costs more than `max_ratio` times the floor's (here
    a forward costs its width: 1, 2, 4, 8, ...); the wider ones are never run."""
    import functools

    def timer_of_widths(self, fn):
        return float(fn.args[0].shape[1]) if isinstance(fn, functools.partial) else 0.5  # the commit: 0.5

    monkeypatch.setattr(calibration_module._Timer, "__call__", timer_of_widths)
    table = budget_module.calibrate(dense, [2], [8], progress=False, cuda_graphs=False, max_ratio=2.0)
    (entry,) = table.entries
    assert entry.nodes == [0, 2, 6, 14] and entry.t_ver == [1.0, 2.0, 4.0, 8.0] and entry.t_commit == 0.5
    assert table.meta["max_ratio"] == 2.0
    with pytest.raises(ValueError, match="max_ratio must be > 1"):
        budget_module.calibrate(dense, [2], [8], max_ratio=1.0)


def test_calibrate_times_by_default_the_most_nodes_each_width_holds(dense):
    """The default grid is roots only, the floor and each batch size's capacities: the edges of the steps in which a
    forward's cost rises (`capacities`), within the synthetic trees' size (topk 2, depth 2: 6 nodes a row)."""
    assert budget_module.capacities(1, tree_nodes=6) == [1, 3] and budget_module.capacities(2, tree_nodes=6) == [2, 6]
    assert budget_module.capacities(1) == [1, 3, 7, 15, 31, 63, 127]
    assert all(select_module.row_width(n, 4, 128) == n // 4 + 1 for n in budget_module.capacities(4))  # full rows
    table = budget_module.calibrate(
        dense, [1, 2], [8], topk=2, depth=2, warmup=1, reps=1, progress=False, cuda_graphs=False, max_ratio=1e9
    )  # fmt: skip
    assert [(e.batch_size, e.nodes) for e in table.entries] == [(1, [0, 1, 3]), (2, [0, 2, 6])]


def test_calibrate_times_the_compiled_forward(dense, monkeypatch):
    """`compile=True` times the forward `bole_compile=True` runs, under a key of its own."""
    import hf_bole.models.adapter as adapter

    compiled = []

    def traced(decoder):
        compiled.append(decoder)
        return torch.compile(decoder.forward, backend="eager")

    monkeypatch.setattr(adapter, "_compiled", traced)
    table = budget_module.calibrate(
        dense, [1], [8], [0, 2], warmup=1, reps=1, progress=False, cuda_graphs=False, compile=True,
        attention="model",
    )  # fmt: skip
    twin = tree_twin(dense.get_decoder(), projections=True, norms=False).module  # what a compiled forward runs
    assert table.key.launch == "compiled-eager" and compiled and set(compiled) == {twin}


@pytest.mark.skipif(not torch.empty(0).is_cuda, reason="CUDA graphs need a GPU (HF_BOLE_TEST_DEVICE=cuda)")
def test_calibrate_replays_graphs(dense):
    table = budget_module.calibrate(dense, [1, 2], [16], [0, 2, 8], warmup=2, reps=3, progress=False)
    assert table.key.launch == "triton-attention-graphs" and table.meta["launched"] == "replayed from CUDA graphs"
    assert all(e.t_floor > 0 and e.t_commit > 0 and len(e.t_ver) == len(e.nodes) for e in table.entries)
    assert [e.nodes for e in table.entries] == [[0, 1, 2, 8], [0, 2, 8]]  # the floor N = batch size added at batch 1


@pytest.mark.usefixtures("torch_gdn")  # a CPU model: fla-core's kernels, where importable, take GPU tensors only
def test_cli_on_tiny_checkpoint(dense, tmp_path, budget_cache, capsys):
    folder = tmp_path / "tiny"
    dense.save_pretrained(folder)
    out = tmp_path / "table.json"
    argv = ["--model", str(folder), "--device", "cpu", "--dtype", "fp32", "--batch-sizes", "1", "2",
            "--kv-lengths", "8", "--nodes", "0", "4", "--warmup", "1", "--reps", "1", "--out", str(out)]  # fmt: skip
    assert calibrate_main(argv) == 0
    key = TableKey(model_key(dense.config), "cpu", "float32", "closed_form", "eager")  # save/load keeps the key
    table = BudgetTable.load(out)
    assert table.key == key and table.epsilon == BoleConfig().epsilon
    assert [(e.batch_size, e.kv_length, e.nodes) for e in table.entries] == [(1, 8, [0, 1, 4]), (2, 8, [0, 2, 4])]
    assert all(e.t_floor == e.t_ver[1] and e.t_commit > 0 and all(t > 0 for t in e.t_ver) for e in table.entries)
    assert all(e.budget == choose_budget(e.nodes, e.t_ver, e.t_commit, e.batch_size, table.epsilon)
               for e in table.entries)  # fmt: skip
    # plain decoding, or at least one node a request (the floor)
    assert all(e.budget == 0 or e.budget >= e.batch_size for e in table.entries)
    assert table.meta["timer"] == "perf_counter" and table.meta["topk"] == BoleConfig().topk
    assert find_table(key) == table  # also in the cache folder, where "auto" looks
    assert out.with_suffix(".png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and f"wrote {budget_cache / key.filename}" in printed


@pytest.mark.usefixtures("torch_gdn")
def test_cli_saves_after_every_bucket(dense, tmp_path, budget_cache, monkeypatch):
    """A run cut short keeps the buckets it finished: the table is written after each one."""
    folder = tmp_path / "tiny"
    dense.save_pretrained(folder)
    out = tmp_path / "table.json"
    measure, measured = calibration_module._measure_bucket, []

    def stop_at_the_second_batch_size(model, b, *args):
        if measured:
            assert [e.batch_size for e in BudgetTable.load(out).entries] == measured  # on disk before the next
            raise KeyboardInterrupt  # the run ends inside a bucket, as a time limit ends it
        measure(model, b, *args)
        measured.append(b)

    monkeypatch.setattr(calibration_module, "_measure_bucket", stop_at_the_second_batch_size)
    argv = ["--model", str(folder), "--device", "cpu", "--dtype", "fp32", "--batch-sizes", "1", "2",
            "--kv-lengths", "8", "--nodes", "0", "4", "--warmup", "1", "--reps", "1", "--out", str(out)]  # fmt: skip
    with pytest.raises(KeyboardInterrupt):
        calibrate_main(argv)
    key = TableKey(model_key(dense.config), "cpu", "float32", "closed_form", "eager")
    for table in (BudgetTable.load(out), find_table(key)):
        assert [(e.batch_size, e.nodes) for e in table.entries] == [(1, [0, 1, 4])]


@pytest.mark.usefixtures("torch_gdn")
def test_cli_calibrates_a_named_shape_into_a_table_dir(tmp_path, budget_cache):
    """`--shape` builds the published shape from the package alone (no repository), and `--table-dir` takes the
    table where the cache folder would: keyed by that shape."""
    from hf_bole.shapes import shape_config

    folder = tmp_path / "shape"
    shape_config("9B", **SMALL_9B).save_pretrained(folder)
    argv = ["--shape", str(folder), "--device", "cpu", "--dtype", "fp32", "--batch-sizes", "1", "--kv-lengths", "8",
            "--nodes", "0", "2", "--warmup", "1", "--reps", "1", "--table-dir", str(tmp_path / "tables")]  # fmt: skip
    assert calibrate_main(argv) == 0
    key = TableKey(model_key(shape_config("9B", **SMALL_9B)), "cpu", "float32", "closed_form", "eager")
    assert find_table(key, tmp_path / "tables").key == key
    assert not budget_cache.exists()


def test_cli_rejects(capsys):
    with pytest.raises(SystemExit):
        calibrate_main(["--model", "x", "--shape", "9B"])
    with pytest.raises(SystemExit):
        calibrate_main(["--model", "x", "--epsilon", "-1"])
    assert "--epsilon must be >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        calibrate_main(["--model", "x", "--max-ratio", "1"])
    assert "--max-ratio must be > 1" in capsys.readouterr().err


def test_public_names():
    assert hf_bole.BoleConfig().budget == "auto"


def test_calibrate_refuses_spread_models(dense, monkeypatch):
    """A model over two GPUs (accelerate hooks, as device_map="auto" leaves them) is not calibrated: the message says
    what generate does instead."""
    blocks = [dense.model.embed_tokens, *dense.model.layers, dense.lm_head]
    for i, block in enumerate(blocks):
        monkeypatch.setattr(block, "_hf_hook", SimpleNamespace(execution_device=int(i > 2)), raising=False)
    monkeypatch.setattr(dense, "hf_device_map", {"model.layers.0": 0, "model.layers.2": 1}, raising=False)
    with pytest.raises(ValueError, match="spread over 2 devices.*bole_budget=<int>"):
        budget_module.calibrate(dense, batch_sizes=[1], kv_lengths=[8], nodes=[0, 4])


def test_calibrate_times_the_tree_attention_kernel(dense, monkeypatch):
    """`attention="triton"` times forwards whose attention layers call tree_attention, under a key of its own."""
    import hf_bole.kernels as kernels

    calls = []
    attention = kernels.tree_attention
    monkeypatch.setattr(kernels, "tree_attention", lambda *a, **k: calls.append(1) or attention(*a, **k))
    table = budget_module.calibrate(
        dense, [1], [8], [0, 2], warmup=1, reps=1, progress=False, cuda_graphs=False, attention="triton"
    )  # fmt: skip
    assert table.key.launch == "triton-attention-eager" and calls


def test_generate_never_widens_a_call_as_its_rows_finish(dense, monkeypatch):
    """A call of 3 rows under a table whose one-row budget is 63 nodes and three-row budget 9: every round keeps
    each row within the 3 nodes a row gets at 3 rows, also once rows have finished, and the drafter is asked for
    no more; the output is plain greedy's."""
    entries = [
        _entry(1, 1024, [1.0] * 7, [0, 1, 3, 7, 15, 31, 63]),  # 63 at epsilon 0.3
        _entry(3, 1024, [1.0, 1.0, 1.05, 1.5], [0, 3, 9, 21]),  # 9: 3 a row
    ]
    table = BudgetTable(TableKey("m", "NVIDIA H200", "bfloat16", "closed_form", "graphs"), 0.3, entries)
    from_table = lambda cls, model, config, batch_size: cls.from_table(table, 0.3, batch_size)  # noqa: E731
    monkeypatch.setattr(BudgetResolver, "for_model", classmethod(from_table))
    rounds, asked = [], []

    def select_round(tree, root_tokens, budget, max_nodes_per_row, active=None, safe=None):
        rounds.append((int(active.sum()), budget, max_nodes_per_row))
        return select_nodes(prepared_tree(tree, active, safe), root_tokens, budget, max_nodes_per_row)

    monkeypatch.setattr(loop, "select_round", select_round)
    ngram = hf_bole.generation.NgramDrafter(BoleConfig(depth=8))
    propose = ngram.propose
    monkeypatch.setattr(ngram, "propose", lambda ctx: asked.append(ctx.max_nodes) or propose(ctx))
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [3, 4, 3, 4, 3, 4], [9, 9, 9, 9, 9]]
    probe = _generate(dense, prompts)
    eos = [int(probe[0, -11]), int(probe[1, -6]), int(probe[2, -3])]  # rows stop 2, 7 and 10 tokens in
    ref = _generate(dense, prompts, eos_token_id=eos)
    out = _generate(dense, prompts, eos_token_id=eos, custom_generate="hf_bole", bole_drafter=ngram,
                    bole_cuda_graphs=False)  # fmt: skip
    assert torch.equal(out, ref)
    assert {rows for rows, *_ in rounds} > {3}  # rows finished before the last round
    assert all(budget == 3 * rows and cap == 3 for rows, budget, cap in rounds) and set(asked) == {3}
