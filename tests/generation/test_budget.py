"""The verification budget: B_ver from timings, tables (keys, storage, look-up), "auto" in generate, the CLI."""

from __future__ import annotations

import json
import logging
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

NODES = [0, 16, 32, 64]


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
    "t_ver, epsilon, expected",
    [
        # ratios 1.05, 1.08, 1.12, 1.5 against a limit of 1.1: 32 is just over, 16 the last within
        pytest.param([1.05, 1.08, 1.12, 1.5], 0.1, 16, id="monotone"),
        pytest.param([1.05, 1.08, 1.12, 1.5], 0.5, 64, id="large-epsilon-takes-all"),
        pytest.param([1.0, 1.0, 1.0, 1.01], 0.0, 32, id="epsilon-0-equality-counts"),
        pytest.param([1.0, 1.1, 1.2, 1.3], 0.1, 16, id="boundary-inclusive"),
        # nothing within 1.1, not even the roots alone: 0, the floor of one root child per request
        pytest.param([1.3, 1.4, 1.5, 1.6], 0.1, 0, id="none-qualifies"),
        pytest.param([1.0, 1.4, 1.5, 1.6], 0.1, 0, id="only-roots"),
        # 16 is over the limit but 32 is under (it tiles better): the largest qualifying N wins
        pytest.param([1.0, 1.2, 1.05, 1.3], 0.1, 32, id="non-monotone"),
        pytest.param([1.2, 1.3, 1.4, 1.09], 0.1, 64, id="non-monotone-last"),
    ],
)
def test_choose_budget(t_ver, epsilon, expected):
    assert choose_budget(NODES, t_ver, t_dec=1.0, epsilon=epsilon) == expected
    # scale-free: milliseconds or seconds give the same choice
    assert choose_budget(NODES, [7.5 * t for t in t_ver], t_dec=7.5, epsilon=epsilon) == expected


def test_choose_budget_rejects():
    with pytest.raises(ValueError, match="epsilon must be >= 0"):
        choose_budget(NODES, [1.0] * 4, 1.0, -0.1)
    with pytest.raises(ValueError, match="4 node counts but 3 timings"):
        choose_budget(NODES, [1.0] * 3, 1.0, 0.1)


def _table(key: TableKey | None = None) -> BudgetTable:
    """Batch buckets 1 and 4, KV buckets 512 and 2048; ratios chosen so each bucket picks a different budget."""
    ratios = {
        (1, 512): [1.0, 1.02, 1.05, 1.3],  # eps 0.1: 32; eps 0.3: 64
        (1, 2048): [1.0, 1.05, 1.2, 1.4],  # 16; 32
        (4, 512): [1.0, 1.08, 1.5, 2.0],  # 16; 16
        (4, 2048): [1.0, 1.2, 1.6, 2.4],  # 0; 16
    }
    entries = [
        BudgetEntry(b, kv, 2.0, NODES, [2.0 * r for r in rs], choose_budget(NODES, rs, 1.0, 0.1))
        for (b, kv), rs in ratios.items()
    ]
    key = key or TableKey("qwen3_5_text-h64-l4-0123456789", "NVIDIA H200", "bfloat16", "closed_form", "graphs")
    return BudgetTable(key, 0.1, entries, meta={"topk": 4})


@pytest.mark.parametrize(
    "active, kv, epsilon, expected",
    [
        pytest.param(1, 512, 0.1, 32, id="exact-bucket"),
        pytest.param(1, 2047, 0.1, 32, id="kv-rounds-down"),
        pytest.param(1, 100, 0.1, 32, id="kv-below-all"),
        pytest.param(1, 10**6, 0.1, 16, id="kv-above-all"),
        # between batch buckets 1 (32 at KV 512) and 4 (16): two thirds of the way, 32 - 16 * 2 / 3, rounded
        pytest.param(3, 600, 0.1, 21, id="batch-between-buckets"),
        pytest.param(2, 2048, 0.3, 27, id="batch-between-buckets-large-kv"),  # 32 - 16 / 3
        pytest.param(4, 512, 0.1, 16, id="batch-bucket"),
        pytest.param(64, 4096, 0.1, 0, id="batch-above-all"),
        pytest.param(1, 512, 0.3, 64, id="epsilon-chooses-again"),
        pytest.param(4, 2048, 0.3, 16, id="epsilon-chooses-again-large-batch"),
    ],
)
def test_resolver_looks_up_buckets(active, kv, epsilon, expected):
    resolver = BudgetResolver.from_table(_table(), epsilon)
    assert resolver(active, kv) == expected
    assert resolver.max_budget == (32 if epsilon == 0.1 else 64)


def test_resolver_follows_budgets_that_rise_with_the_batch():
    """As on the house model (budgets 32, 64 and 384 at 1, 4 and 8 requests): a batch of 8 whose rows finish one by
    one walks down the line between the buckets, not down to the 4-request budget at its first finished row."""
    nodes = [0, 32, 64, 384, 512]
    chosen = {1: [1.0, 1.1, 1.4, 2.0, 2.5], 4: [1.0, 1.1, 1.2, 1.5, 2.0], 8: [1.0, 1.0, 1.1, 1.2, 1.5]}
    entries = [
        BudgetEntry(b, 1024, 1.0, nodes, ratios, choose_budget(nodes, ratios, 1.0, 0.3))
        for b, ratios in chosen.items()
    ]
    table = BudgetTable(TableKey("m", "NVIDIA H200", "bfloat16", "closed_form", "graphs"), 0.3, entries, meta={})
    resolver = BudgetResolver.from_table(table, epsilon=0.3)
    assert [resolver(rows, 1024) for rows in range(1, 11)] == [32, 43, 53, 64, 144, 224, 304, 384, 384, 384]
    assert resolver.max_budget == 384


def test_resolver_fixed_and_fallback(dense):
    assert BudgetResolver.for_model(dense, BoleConfig(budget=7), batch_size=4)(3, 100) == 7
    fallback = BudgetResolver.fallback(batch_size=8)
    assert [fallback(a, 10) for a in (1, 2, 4, 8)] == [31, 62, 124, 128]  # 31 per request, at most 128
    assert fallback.max_budget == 128 == fallback_budget(8)
    assert fallback_budget(1) == BudgetResolver.fallback(batch_size=1).max_budget == 31
    # one request's fallback tree fills the verify width of 32 with its root, the widest at the GDN solve's least tile
    assert select_module.row_width(fallback_budget(1), 1, fallback_budget(1) + 1) == 32


def test_table_round_trip(budget_cache):
    table = _table()
    path = table.save(table.default_path())
    assert path == budget_cache / "qwen3_5_text-h64-l4-0123456789__NVIDIA-H200__bfloat16__closed_form__graphs.json"
    assert cache_dir() == budget_cache
    data = json.loads(path.read_text())
    assert data["format"] == 4 and data["epsilon"] == 0.1 and data["meta"] == {"topk": 4}
    key = {"model": table.key.model, "device": "NVIDIA H200", "dtype": "bfloat16", "verify": "closed_form",
           "launch": "graphs"}  # fmt: skip
    assert data["key"] == key
    assert data["entries"][0] == {"batch_size": 1, "kv_length": 512, "t_dec": 2.0, "nodes": NODES,
                                  "t_ver": [2.0, 2.04, 2.1, 2.6], "budget": 32}  # fmt: skip
    assert BudgetTable.load(path) == table
    assert find_table(table.key) == table
    assert find_table(TableKey(table.key.model, "NVIDIA H100", "bfloat16", "closed_form", "graphs")) is None
    assert find_table(TableKey(table.key.model, "NVIDIA H200", "bfloat16", "serial", "graphs")) is None
    assert find_table(TableKey(table.key.model, "NVIDIA H200", "bfloat16", "closed_form", "eager")) is None
    data["format"] = 0
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="format 0 is not 4: calibrate again"):
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
    assert "31 draft nodes per active request, at most 128" in message
    for resolver in resolvers:
        assert resolver.source == "fallback" and resolver(2, 1000) == 62 and resolver.max_budget == 124
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
        BudgetResolver.for_model(model, BoleConfig(epsilon=0.3), batch_size=4)
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, f"hf_bole: budget='auto' reads the verification budget table {_table(key).default_path()}")
    ]  # once
    assert resolver(1, 512) == 64 and resolver(4, 4096) == 16  # chosen again at epsilon 0.3


def test_auto_finds_a_shipped_table_after_the_users(monkeypatch, caplog):
    """The tables shipped in the package (hf_bole/budgets/) are read when the user's cache folder holds none for the
    key; one in the cache folder (the user's own calibration) comes first. The log line says which file is read."""
    model = _fake_gpu_model(monkeypatch)
    key = TableKey.for_model(model)
    shipped_path = _table(key).save(tables_module.PACKAGE_TABLES / key.filename)  # at epsilon 0.3: 64 at batch 1
    with caplog.at_level(logging.INFO, logger="hf_bole.generation.budget"):
        resolver = BudgetResolver.for_model(model, BoleConfig(epsilon=0.3), batch_size=4)
    assert str(shipped_path) in caplog.records[-1].getMessage() and resolver(1, 512) == 64
    own = _table(key)
    own.entries[0].t_ver[-1] = 9.0  # and 32 in the user's
    own_path = own.save(own.default_path())
    with caplog.at_level(logging.INFO, logger="hf_bole.generation.budget"):
        resolver = BudgetResolver.for_model(model, BoleConfig(epsilon=0.3), batch_size=4)
    assert str(own_path) in caplog.records[-1].getMessage() and resolver(1, 512) == 32


def test_package_ships_the_house_table():
    """The house model's H200 table is package data, keyed by the house checkpoint's shape."""
    from transformers import AutoConfig

    from eval.shapes import HOUSE_CHECKPOINT

    folder = tables_module.Path(tables_module.__file__).resolve().parents[2] / "budgets"
    key = TableKey(model_key(AutoConfig.from_pretrained(HOUSE_CHECKPOINT)), "NVIDIA H200", "bfloat16", "closed_form",
                   "triton-attention-graphs")  # fmt: skip
    table = find_table(key, folder)
    assert table is not None and table.key == key and {e.batch_size for e in table.entries} == {1, 4, 8, 16}


def test_auto_with_an_older_table_warns_and_falls_back(monkeypatch, caplog):
    """A table of format 3 timed replayed forwards at the widest row's bucket, which generate no longer runs (it
    caps rows at `graphs.row_width`): generate does not read it, says which file, why, and how to measure it again."""
    model = _fake_gpu_model(monkeypatch)
    table = _table(TableKey.for_model(model))
    path = table.save(table.default_path())
    data = json.loads(path.read_text())
    data["format"] = 3
    path.write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING, logger="hf_bole.generation.budget"):
        resolver = BudgetResolver.for_model(model, BoleConfig(), batch_size=4)
    assert resolver.source == "fallback" and resolver(2, 1000) == 62
    message = caplog.records[0].getMessage()
    assert str(path) in message and "format 3 is not 4" in message
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
        "active request, at most 128 per round (pass bole_budget=<int> to fix it)"
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

    def rule(active_rows, kv_length):
        calls.append((active_rows, kv_length))
        return 1 + len(calls) % 3  # 2, 3, 1, 2, ...: changes every round

    monkeypatch.setattr(BudgetResolver, "for_model", classmethod(lambda cls, *a: cls(rule, 3, "test")))
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
    kept, as in the decoding loop (at batch 4 a budget of 8 leaves each row a few nodes, not 8)."""
    widths = []
    forward = verify_module.tree_forward
    def recorded(model, cache, ids, *args, **kwargs):
        widths.append(ids.shape[1])
        return forward(model, cache, ids, *args, **kwargs)

    monkeypatch.setattr(verify_module, "tree_forward", recorded)
    table = budget_module.calibrate(
        dense, [4], [8], [0, 8], warmup=1, reps=1, progress=False, cuda_graphs=False, attention="model"
    )  # fmt: skip
    assert table.key.launch == "eager"
    assert table.meta["t_dec"] == "floor verify forward (N = batch size), launched from Python"
    assert widths[:2] == [1, 1]  # roots only, warm-up and timed call
    assert widths[2:4] == [2, 2]  # the floor (N = 4): each row's best root child, whose time is T_dec
    assert 2 <= max(widths[4:]) < 1 + 8
    (entry,) = table.entries
    assert entry.nodes == [0, 4, 8] and entry.t_dec == entry.t_ver[1]


def test_calibrate_times_by_default_the_most_nodes_each_width_holds(dense):
    """The default grid is roots only, the floor and each batch size's capacities: the edges of the steps in which a
    forward's cost rises (`capacities`), within the synthetic trees' size (topk 2, depth 2: 6 nodes a row)."""
    assert budget_module.capacities(1, tree_nodes=6) == [3] and budget_module.capacities(2, tree_nodes=6) == [6]
    assert budget_module.capacities(1) == [3, 7, 15, 31, 63, 127]
    assert all(select_module.row_width(n, 4, 128) == n // 4 + 1 for n in budget_module.capacities(4))  # full rows
    table = budget_module.calibrate(
        dense, [1, 2], [8], topk=2, depth=2, warmup=1, reps=1, progress=False, cuda_graphs=False
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
    assert table.key.launch == "triton-attention-graphs" and table.meta["t_dec"] == "floor verify forward (N = batch size), replayed"
    assert all(e.t_dec > 0 and len(e.t_ver) == len(e.nodes) for e in table.entries)
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
    assert all(e.t_dec == e.t_ver[1] and all(t > 0 for t in e.t_ver) for e in table.entries)
    # the floor always fits, so every budget covers one node per request
    assert all(e.budget == choose_budget(e.nodes, e.t_ver, e.t_dec, table.epsilon) for e in table.entries)
    assert all(e.budget >= e.batch_size for e in table.entries)
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
