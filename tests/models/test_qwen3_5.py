"""Tree-mode Qwen3.5: every node's logits equal plain token-by-token decoding of its path; plain forwards and
`generate` through a BoleCache equal upstream."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from hf_bole.cache import BoleCache
from hf_bole.kernels import tree_ancestor_mask
from hf_bole.models import TreeBatch, check_supported_model, family_of, tree_forward
from hf_bole.models.adapter import _tree_causal_conv1d_fn, _tree_gated_delta_rule
from hf_bole.models.twin import tree_twin
from tests.models.tiny import (
    VOCAB,
    batch_trees,
    build_model,
    left_pad,
    prefill,
    random_path,
    random_tree,
    reference_tree_logits,
    text_config,
)

# Compared with transformers' torch GDN path, also where fla-core would take over (see the fixture).
pytestmark = pytest.mark.usefixtures("torch_gdn")

PROMPTS = [[5, 17, 33, 2, 41, 9, 60], [71, 3, 28, 44], [13]]  # left padding of 0, 3 and 6


def make_trees(shape: str, gen: torch.Generator) -> list[list[int]]:
    if shape == "chain":
        return [[-1, 0, 1, 2, 3, 4]] * 3
    if shape == "star":
        return [[-1] + [0] * 6] * 3
    if shape == "deep":
        return [random_tree(9, max_depth=7, gen=gen) for _ in range(3)]
    if shape == "bushy":
        return [random_tree(10, max_depth=2, gen=gen) for _ in range(3)]
    # ragged: a tree of its own size per row, padded with parent -1 nodes
    return [random_tree(9, max_depth=4, gen=gen), [-1, 0, 1], [-1, 0, 0, 0, 3]]


def check_tree_logits(model, cache, committed, roots, trees, gen, verify="closed_form", attention="model"):
    """Runs one tree round and compares every real node with the plain reference; returns the node tokens."""
    parents = batch_trees(trees)
    tokens = torch.randint(1, VOCAB, parents.shape, generator=gen)
    tokens[:, 0] = roots
    out = tree_forward(model, cache, tokens, parents, verify=verify, attention=attention)
    assert out.logits.shape == (3, parents.shape[1], VOCAB)
    torch.testing.assert_close(out.logits, model.get_output_embeddings()(out.hidden_states))
    for b, tree in enumerate(trees):
        ref = reference_tree_logits(model, committed[b], tokens[b, : len(tree)].tolist(), tree)
        torch.testing.assert_close(out.logits[b, : len(tree)], ref, atol=1e-4, rtol=1e-4)
    return tokens, out


@pytest.mark.parametrize(
    "kind, shape, attn, attention",
    [
        pytest.param("dense", "chain", "sdpa", "model", id="dense-chain"),
        pytest.param("dense", "star", "sdpa", "model", id="dense-star"),
        pytest.param("dense", "deep", "sdpa", "model", id="dense-deep"),
        pytest.param("dense", "ragged", "eager", "model", id="dense-ragged-eager"),
        pytest.param("moe", "bushy", "sdpa", "model", id="moe-bushy"),
        pytest.param("moe", "ragged", "sdpa", "model", id="moe-ragged"),
        pytest.param("vl", "ragged", "sdpa", "model", id="vl-ragged"),
        pytest.param("dense", "deep", "eager", "triton", id="dense-deep-tree-attention-torch"),
        pytest.param(
            "moe", "ragged", "sdpa", "triton", id="moe-ragged-tree-attention-kernel", marks=pytest.mark.interpreter
        ),
    ],
)
def test_tree_forward(kind, shape, attn, attention):
    """Two rounds, so that the second starts from rows of different committed lengths."""
    gen = torch.Generator(torch.get_default_device()).manual_seed(1)
    model = build_model(kind, attn)
    cache = BoleCache(model.config, batch_size=3)
    roots = prefill(model, cache, PROMPTS)
    committed = [list(p) for p in PROMPTS]
    for _ in range(2):
        trees = make_trees(shape, gen)
        tokens, out = check_tree_logits(model, cache, committed, roots, trees, gen, attention=attention)
        paths = [random_path(tree, gen) for tree in trees]
        cache.commit(out.tree_round, batch_trees(paths))  # -1 right-padding, as commit expects
        for b, path in enumerate(paths):
            committed[b] += tokens[b, path].tolist()
        roots = out.logits[torch.arange(3), [p[-1] for p in paths]].argmax(-1)


def test_tree_attention_serves_every_full_attention_layer(monkeypatch):
    """With attention="triton" every full-attention layer of a tree forward calls `tree_attention` once (and the
    model's attention function never), giving the logits of attention="model"; plain forwards keep the model's."""
    import hf_bole.kernels as kernels
    from transformers.integrations import sdpa_attention

    calls = {"tree": 0, "sdpa": 0}

    def counted(name, function):
        def call(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)

        return call

    monkeypatch.setattr(kernels, "tree_attention", counted("tree", kernels.tree_attention))
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sdpa = counted("sdpa", sdpa_attention.sdpa_attention_forward)
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "sdpa", sdpa)
    gen = torch.Generator(torch.get_default_device()).manual_seed(5)
    model = build_model()
    attention_layers = model.config.layer_types.count("full_attention")
    caches = [BoleCache(model.config, batch_size=3) for _ in range(2)]
    parents = batch_trees(make_trees("ragged", gen))
    tokens = torch.randint(1, VOCAB, parents.shape, generator=gen)
    for cache in caches:
        tokens[:, 0] = prefill(model, cache, PROMPTS)
    assert calls == {"tree": 0, "sdpa": 2 * attention_layers}  # the prefills
    reference = tree_forward(model, caches[0], tokens, parents, attention="model")
    assert calls == {"tree": 0, "sdpa": 3 * attention_layers}
    out = tree_forward(model, caches[1], tokens, parents, attention="triton")
    assert calls == {"tree": attention_layers, "sdpa": 3 * attention_layers}
    torch.testing.assert_close(out.logits, reference.logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", ["deep", "root-only"])
def test_tree_forward_leaves_committed_state(shape):
    """Also a one-node tree, which transformers would otherwise send down its one-token decode path (whose conv
    update writes the committed window in place)."""
    gen = torch.Generator(torch.get_default_device()).manual_seed(2)
    model = build_model()
    cache = BoleCache(model.config, batch_size=3)
    prefill(model, cache, PROMPTS)
    before = {name: getattr(cache, name).clone() for name in ("lengths", "positions")}
    states = [(layer.conv_states[0].clone(), layer.recurrent_states[0].clone()) for layer in cache.layers[:3]]
    keys = cache.layers[3].keys[:, :, :7].clone()
    parents = batch_trees(make_trees("deep", gen) if shape == "deep" else [[-1]] * 3)
    tree_forward(model, cache, torch.randint(1, VOCAB, parents.shape, generator=gen), parents)
    for name, value in before.items():
        torch.testing.assert_close(getattr(cache, name), value, rtol=0, atol=0)
    for layer, (conv, recurrent) in zip(cache.layers[:3], states):
        torch.testing.assert_close(layer.conv_states[0], conv, rtol=0, atol=0)
        torch.testing.assert_close(layer.recurrent_states[0], recurrent, rtol=0, atol=0)
    torch.testing.assert_close(cache.layers[3].keys[:, :, :7], keys, rtol=0, atol=0)


def test_serial_matches_closed_form():
    """Same logits and the same committed cache from both verification schemes."""
    model = build_model("moe")
    caches = {v: BoleCache(model.config, batch_size=3) for v in ("closed_form", "serial")}
    gen = torch.Generator(torch.get_default_device()).manual_seed(3)
    trees = make_trees("ragged", gen)
    parents = batch_trees(trees)
    tokens = torch.randint(1, VOCAB, parents.shape, generator=gen)
    paths = batch_trees([random_path(tree, gen) for tree in trees])
    logits, sizes = {}, {}
    for verify, cache in caches.items():
        tokens[:, 0] = prefill(model, cache, PROMPTS)
        out = tree_forward(model, cache, tokens, parents, verify=verify)
        logits[verify], sizes[verify] = out.logits, out.tree_round.transient_bytes
        cache.commit(out.tree_round, paths)
    torch.testing.assert_close(logits["serial"], logits["closed_form"], atol=1e-5, rtol=1e-5)
    closed, serial = caches["closed_form"], caches["serial"]
    torch.testing.assert_close(serial.lengths, closed.lengths, rtol=0, atol=0)
    for a, b in zip(serial.layers[:3], closed.layers[:3]):
        torch.testing.assert_close(a.conv_states[0], b.conv_states[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.recurrent_states[0], b.recurrent_states[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(serial.layers[3].keys, closed.layers[3].keys, atol=1e-5, rtol=1e-5)
    assert sizes["serial"]["snapshots"] > 0 and sizes["serial"]["factors"] == 0
    assert sizes["closed_form"]["factors"] > 0 and sizes["closed_form"]["snapshots"] == 0


def _eager_norms_and_rotary_as_compiled(monkeypatch) -> None:
    """The eager tree forward with transformers' RMSNorms and rotary embeddings, as the compiled forward runs them
    (inductor fuses those itself): hf_bole's norm kernel sums in another order, so on CUDA a few entries round
    differently from transformers' (tests/kernels/test_rmsnorm.py), and a bit-for-bit comparison of the compiled
    forward with the eager one would fail there for that alone."""
    import hf_bole.models.adapter as adapter

    twin = adapter.tree_twin
    monkeypatch.setattr(adapter, "tree_twin", lambda decoder, projections, norms: twin(decoder, projections, False))
    monkeypatch.setattr(adapter, "rotary_fused", contextlib.nullcontext)


@pytest.mark.parametrize(
    "verify, attention", [("closed_form", "model"), ("serial", "model"), ("closed_form", "triton")]
)
def test_compiled_tree_forward_is_one_graph(verify, attention, monkeypatch):
    """Under torch.compile the tree kernels are custom ops, not graph breaks: dynamo traces the whole decoder into
    one graph (`fullgraph=True` raises at any break), and that graph, run as traced, gives the eager logits."""
    import hf_bole.models.adapter as adapter

    traced_decoders = []

    def traced(decoder):
        traced_decoders.append(decoder)
        return torch.compile(decoder.forward, backend="eager", fullgraph=True)

    monkeypatch.setattr(adapter, "_compiled", traced)
    _eager_norms_and_rotary_as_compiled(monkeypatch)
    gen = torch.Generator(torch.get_default_device()).manual_seed(4)
    model = build_model()
    caches = [BoleCache(model.config, batch_size=3) for _ in range(2)]
    parents = batch_trees(make_trees("ragged", gen))
    tokens = torch.randint(1, VOCAB, parents.shape, generator=gen)
    for cache in caches:
        tokens[:, 0] = prefill(model, cache, PROMPTS)
    eager = tree_forward(model, caches[0], tokens, parents, verify=verify, attention=attention)
    compiled = tree_forward(model, caches[1], tokens, parents, verify=verify, compile=True, attention=attention)
    assert traced_decoders == [tree_twin(model.get_decoder(), projections=True, norms=False).module]
    torch.testing.assert_close(compiled.logits, eager.logits, rtol=0, atol=0)


def test_compile_serves_every_width_from_its_second_graph(monkeypatch, caplog):
    """`bole_compile` compiles static for the first tree, then once more with the sizes that changed symbolic: the
    third width and cache capacity reuse that graph (dynamo traces the tree kernels' fake implementations with
    symbolic sizes), with the eager logits, also from a tree given as a narrowed view (as the loop cuts selection's
    padded rows), whose strides differ."""
    import hf_bole.models.adapter as adapter

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch_compile = torch.compile  # adapter._compiled's own call, with its settings, on a backend recording graphs
    monkeypatch.setattr(torch, "compile", lambda fn, **settings: torch_compile(fn, **{**settings, "backend": backend}))
    monkeypatch.setattr(adapter, "_COMPILED", type(adapter._COMPILED)())
    _eager_norms_and_rotary_as_compiled(monkeypatch)
    torch._dynamo.reset()  # forget the sizes earlier tests' compiles saw change, which dynamo keeps per code object
    model = build_model()
    gen = torch.Generator(torch.get_default_device()).manual_seed(5)
    for n in (5, 9, 14):
        parents = batch_trees([random_tree(n, max_depth=4, gen=gen) for _ in range(3)])
        tokens = torch.randint(1, VOCAB, parents.shape, generator=gen)
        if n == 14:  # views into wider [3, n + 2] tensors
            tokens = torch.cat([tokens, tokens[:, :2]], dim=1)[:, :n]
            parents = torch.cat([parents, parents[:, :2]], dim=1)[:, :n]
        logits = []
        for compile in (False, True):
            cache = BoleCache(model.config, batch_size=3, max_cache_len=32 + n)
            tokens[:, 0] = prefill(model, cache, PROMPTS)
            with caplog.at_level(logging.WARNING):
                logits.append(tree_forward(model, cache, tokens, parents, compile=compile).logits)
        torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=0)
    assert len(graphs) == 2
    assert caplog.text.count("the verify forward compiles through torch.compile") == 1  # said once per model


def test_compiled_tree_forward_hands_its_kernels_no_views_of_storage_later_layers_write(monkeypatch):
    """What made inductor copy whole stacked buffers (seen in a compiled round's kernel log): the traced graph
    writes the tree's KV through the mutating op `hf_bole::write_tree_kv`, which inductor calls in place, never by
    `scatter_` into a view that attention then reads; and the tree conv reads its input from a tensor of its own,
    not from a view of the conv inputs every GDN layer writes into one buffer."""
    import hf_bole.models.adapter as adapter

    graphs = []

    def traced(decoder):
        def backend(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        return torch.compile(decoder.forward, backend=backend, fullgraph=True)

    monkeypatch.setattr(adapter, "_compiled", traced)
    _eager_norms_and_rotary_as_compiled(monkeypatch)
    conv_inputs = []
    update_conv_state = BoleCache.update_conv_state
    monkeypatch.setattr(
        BoleCache, "update_conv_state", lambda self, *a, **k: conv_inputs.append(update_conv_state(self, *a, **k))
        or conv_inputs[-1],
    )
    model = build_model(num_hidden_layers=8)  # two attention layers share one KV stack
    parents = batch_trees(make_trees("ragged", torch.Generator(torch.get_default_device()).manual_seed(6)))
    tokens = torch.randint(1, VOCAB, parents.shape)
    caches = [BoleCache(model.config, batch_size=3) for _ in range(2)]
    for cache in caches:
        tokens[:, 0] = prefill(model, cache, PROMPTS)
    conv_inputs.clear()
    eager = tree_forward(model, caches[0], tokens, parents)
    stack = eager.tree_round.groups[0].conv_io.untyped_storage().data_ptr()
    assert len(conv_inputs) == 6 and all(x.untyped_storage().data_ptr() != stack for x in conv_inputs)
    compiled = tree_forward(model, caches[1], tokens, parents, compile=True)
    (graph,) = graphs
    calls = [n.target for n in graph.graph.nodes if n.op in ("call_function", "call_method")]
    assert calls.count(torch.ops.hf_bole.write_tree_kv.default) == 2 and "scatter_" not in calls
    torch.testing.assert_close(compiled.logits, eager.logits, rtol=0, atol=0)


def test_inductor_graph_with_the_capacity_symbolic_keeps_every_attention_layer(monkeypatch):
    """Through inductor, as `bole_compile` runs it: the graph compiled for a second cache capacity (the next prompt's
    length) has the capacity and the tree width symbolic. Given each attention layer's view of the KV stack to write
    into, that graph passed every layer's view at offset 0 (the first layer's), so the second layer read wrong keys:
    house-model logits off by 1-2, greedy outputs off plain `generate` from the second prompt on.
    The write op now takes the whole stack and the layer's index. What the commit then builds from the round (GDN
    states, conv windows, KV) must match too."""
    import hf_bole.models.adapter as adapter

    monkeypatch.setattr(adapter, "_COMPILED", type(adapter._COMPILED)())
    torch._dynamo.reset()  # a static first graph of its own, not one an earlier test left
    model = build_model(num_hidden_layers=8)  # two attention layers share one KV stack
    gen = torch.Generator(torch.get_default_device()).manual_seed(7)
    for capacity, n in ((32, 9), (96, 14)):  # the second compiles again, with both sizes symbolic
        parents = batch_trees([random_tree(n, max_depth=4, gen=gen) for _ in range(3)])
        tokens = torch.randint(1, VOCAB, parents.shape, generator=gen)
        paths = [random_path(parents[b].tolist(), gen) for b in range(3)]
        path = torch.tensor([p + [-1] * (n - len(p)) for p in paths])  # [3, n], right-padded
        runs = []
        for compile in (False, True):
            cache = BoleCache(model.config, batch_size=3, max_cache_len=capacity)
            tokens[:, 0] = prefill(model, cache, PROMPTS)
            out = tree_forward(model, cache, tokens, parents, compile=compile)
            logits = out.logits
            cache.commit(out.tree_round, path)
            group = cache._groups[0]
            runs.append((logits, group.recurrent, group.conv, group.keys, group.values))
        for compiled, eager in zip(runs[1], runs[0]):
            torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)  # inductor fuses: not bit for bit
    assert tree_twin(model.get_decoder(), projections=True, norms=False).module in adapter._COMPILED


@pytest.mark.parametrize("width", [1, 5])
def test_tree_forward_reads_the_state_storage_on_a_fresh_cache(width, monkeypatch):
    """A tree on an empty cache (the first prefill chain) starts from the cache's own state storage, zeros, not
    from no state: a CUDA graph captured there is replayed after commits, when the storage holds the state. (With
    transformers 5.17 the GDN layers pass a state only where the cache says it has one.)"""
    from hf_bole import kernels

    seen = []
    verify = kernels.tree_gdn_verify
    monkeypatch.setattr(kernels, "tree_gdn_verify", lambda *a, **k: seen.append(a[6]) or verify(*a, **k))
    model = build_model()
    cache = BoleCache(model.config, batch_size=1)
    tokens = torch.randint(1, VOCAB, (1, width))
    tree_forward(model, cache, tokens, torch.arange(width)[None] - 1)
    states = [layer.recurrent_states[0] for layer in cache.layers[:3]]  # the GDN layers
    assert [s.data_ptr() if s is not None else None for s in seen] == [s.data_ptr() for s in states]


@torch.no_grad()
def test_plain_forward_matches_upstream():
    """Prefill and one-token decodes through a BoleCache give upstream's logits (positions as given, or the
    model's default numbering of slots)."""
    model = build_model()
    ids, mask = left_pad(PROMPTS)
    logits = []
    for cache in (DynamicCache(config=model.config), BoleCache(model.config, batch_size=3)):
        out = model(ids, attention_mask=mask, past_key_values=cache)
        steps, m = [out.logits], mask
        for _ in range(3):
            m = torch.cat([m, torch.ones(3, 1, dtype=m.dtype)], dim=1)
            out = model(out.logits[:, -1:].argmax(-1), attention_mask=m, past_key_values=cache)
            steps.append(out.logits)
        logits.append(torch.cat(steps, dim=1))
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind, num_beams", [("dense", 1), ("dense", 2), ("moe", 1), ("vl", 1)])
def test_generate_matches_plain(kind, num_beams):
    model = build_model(kind)
    ids, mask = left_pad(PROMPTS)
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=8, num_beams=num_beams)
    expected = model.generate(ids, **kwargs)
    cache = BoleCache(model.config, batch_size=3 * num_beams)
    torch.testing.assert_close(model.generate(ids, past_key_values=cache, **kwargs), expected, rtol=0, atol=0)


def test_check_supported_model():
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, intermediate_size=32))
    with pytest.raises(ValueError, match="Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM.*got a config of model type 'llama'"):
        check_supported_model(llama)
    config = text_config(layer_types=["full_attention"] * 4)
    with pytest.raises(ValueError, match="at least one of each"):
        check_supported_model(type(build_model())(config))
    assert check_supported_model(build_model("vl")) is family_of(config)
    assert len(family_of(config).model_classes()) == 4


def test_tree_batch_on_other_devices():
    """Each layer of a model spread over devices reads the tree on its own device: copied once per device and round,
    not per layer; on the tree's own device no copy."""
    parents = torch.tensor([[-1, 0, 0, 1]])
    tree = TreeBatch(parents=parents, verify="closed_form", ancestors=tree_ancestor_mask(parents), key_heads=2)
    assert tree.on(parents.device) is tree
    other = torch.device("cpu", 1)  # a second "device" on CPU (tensors made there are CPU tensors)
    copy = tree.on(other)
    assert copy is not tree and copy.parents.data_ptr() != parents.data_ptr()
    assert torch.equal(copy.parents.cpu(), parents.cpu()) and torch.equal(copy.ancestors.cpu(), tree.ancestors.cpu())
    assert tree.on(other) is copy  # the next layer on that device


def test_tree_forward_errors():
    model = build_model()
    cache = BoleCache(model.config, batch_size=3, max_cache_len=10)
    prefill(model, cache, PROMPTS)  # 7 slots used
    ids = torch.ones(3, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="parents must satisfy"):
        tree_forward(model, cache, ids, torch.tensor([[-1, 2, 0]] * 3))
    with pytest.raises(ValueError, match="batch_size=3"):
        tree_forward(model, cache, ids[:2], torch.tensor([[-1, 0, 1]] * 2))
    with pytest.raises(ValueError, match="verify must be"):
        tree_forward(model, cache, ids, torch.tensor([[-1, 0, 1]] * 3), verify="fast")
    with pytest.raises(ValueError, match="attention must be one of"):
        tree_forward(model, cache, ids, torch.tensor([[-1, 0, 1]] * 3), attention="flash")
    big = torch.tensor([[-1] + list(range(4))] * 3)
    with pytest.raises(ValueError, match="max_cache_len=10"):
        tree_forward(model, cache, torch.ones(3, 5, dtype=torch.int64), big)
    with pytest.raises(ValueError, match="needs a BoleCache"):
        tree_forward(model, DynamicCache(config=model.config), ids, torch.tensor([[-1, 0, 1]] * 3))
    with pytest.raises(ValueError, match="layers"):
        tree_forward(model, BoleCache(text_config(num_hidden_layers=8), 3), ids, torch.tensor([[-1, 0, 1]] * 3))


def test_plain_calls_reach_the_kernels_as_called():
    """Outside tree mode the seams pass calls on untouched. fla-core's recurrence (which transformers uses when it is
    installed) takes (q, k, v, g, gk, gv, beta, ...) where the torch reference takes (query, key, value, g, beta,
    ...): re-ordering the arguments would hand beta to gk (it once did: NaN decodes with fla-core 0.6)."""
    calls = []

    def fla_like(q, k, v, g=None, gk=None, gv=None, beta=None, initial_state=None, **kwargs):
        calls.append(dict(g=g, gk=gk, gv=gv, beta=beta, initial_state=initial_state, **kwargs))
        return "o", "state"

    g, beta, state = torch.rand(2), torch.rand(2), torch.rand(2)
    wrapped = _tree_gated_delta_rule(fla_like)
    out = wrapped("q", "k", "v", g=g, beta=beta, initial_state=state, use_qk_l2norm_in_kernel=True)
    assert out == ("o", "state")
    call = calls[0]
    assert call["g"] is g and call["beta"] is beta and call["gk"] is None and call["gv"] is None
    assert call["initial_state"] is state and call["use_qk_l2norm_in_kernel"] is True

    conv_calls = []
    conv = _tree_causal_conv1d_fn(lambda x, weight, bias=None, seq_idx=None, activation=None: conv_calls.append(
        (x, weight, bias, seq_idx, activation)))  # fmt: skip
    conv("x", "w", "b", activation="silu")
    assert conv_calls == [("x", "w", "b", None, "silu")]


def test_overlapping_attention_backend_contexts_restore_the_caller_setting():
    """SDPA's backends are process-wide flags: contexts of two threads that overlap, the first ending first, leave
    cuDNN on for the caller afterwards, and off while either is inside."""
    from hf_bole.models import attention_backends

    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        first, second = attention_backends(), attention_backends()
        first.__enter__()
        second.__enter__()
        first.__exit__(None, None, None)  # as a thread whose call ends while another's runs
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        second.__exit__(None, None, None)
        assert torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
