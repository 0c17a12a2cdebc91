"""BoleCache: tree rounds leave exactly the committed path behind, in every part of the cache, row by row."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from hf_bole.cache import BoleCache, GDNTreeState
from hf_bole.models import tree_forward
from tests.models import tiny_families
from tests.models.tiny import (
    VOCAB,
    batch_trees,
    build_model,
    generate_positions,
    left_pad,
    prefill,
    random_path,
    random_tree,
    reference_cache,
    text_config,
)

# Compared with transformers' torch GDN path, also where fla-core would take over (see the fixture).
pytestmark = pytest.mark.usefixtures("torch_gdn")

PROMPTS = [[5, 17, 33, 2, 41, 9, 60], [71, 3, 28, 44], [13]]
PADDING = [0, 3, 6]


# fp32, a few rounds deep: the tree forward and the plain one sum in other orders, and how far apart that puts them
# depends on the CPU's matmul kernels (1.4e-5 on one key element of an AMD EPYC, within 1e-5 elsewhere).
TOL = {"atol": 5e-5, "rtol": 5e-5}


def assert_rows_match_reference(model, cache, committed):
    """Every part of every row equals transformers' own cache after a plain forward over the row's tokens."""
    for b, tokens in enumerate(committed):
        ref = reference_cache(model, tokens)
        n = len(tokens)
        assert int(cache.lengths[b]) == PADDING[b] + n and int(cache.positions[b]) == n
        for layer, ref_layer in zip(cache.layers, ref.layers):
            if ref_layer.__class__.__name__ == "DynamicLayer":
                slots = slice(PADDING[b], PADDING[b] + n)
                torch.testing.assert_close(layer.keys[b, :, slots], ref_layer.keys[0], **TOL)
                torch.testing.assert_close(layer.values[b, :, slots], ref_layer.values[0], **TOL)
            else:
                torch.testing.assert_close(layer.conv_states[0][b], ref_layer.conv_states[0][0], **TOL)
                torch.testing.assert_close(
                    layer.recurrent_states[0][b], ref_layer.recurrent_states[0][0], **TOL
                )


def _random_round(roots: torch.Tensor, gen: torch.Generator):
    """A round of 3 random trees of 1 to 8 nodes (depth <= 4): the trees, their parents `[3, N]` and random tokens
    `[3, N]` under the given roots."""
    trees = [random_tree(int(torch.randint(1, 9, (1,), generator=gen)), 4, gen) for _ in range(3)]
    parents = batch_trees(trees)
    tokens = torch.randint(1, VOCAB, parents.shape, generator=gen)
    tokens[:, 0] = roots
    return trees, parents, tokens


@pytest.mark.parametrize("verify", ["closed_form", "serial"])
def test_commit(verify):
    """Ten rounds of random trees and accepted paths (rows of their own sizes, sometimes a row that accepts
    nothing): after each commit the cache equals a plain forward over each row's accepted tokens."""
    gen = torch.Generator(torch.get_default_device()).manual_seed(0)
    model = build_model()
    cache = BoleCache(model.config, batch_size=3)
    roots = prefill(model, cache, PROMPTS)
    committed = [list(p) for p in PROMPTS]
    for _ in range(10):
        trees, parents, tokens = _random_round(roots, gen)
        out = tree_forward(model, cache, tokens, parents, verify=verify)
        logits = out.logits
        paths = [random_path(tree, gen) if torch.rand(1, generator=gen) > 0.15 else [] for tree in trees]
        cache.commit(out.tree_round, batch_trees([p or [-1] for p in paths]))
        for b, path in enumerate(paths):
            if path:
                committed[b] += tokens[b, path].tolist()
                roots[b] = logits[b, path[-1]].argmax()
        assert_rows_match_reference(model, cache, committed)


def test_commit_moves_exact_slots():
    """Position ids as values (FLA's test_cache idea): KV slots, conv windows and GDN states after a commit
    hold exactly the accepted nodes, in path order, and the tree round's mask and positions are exact."""
    cache = BoleCache(text_config(), batch_size=3)
    B, T, D, W = 3, 4, cache._conv_dim, 4
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1], [0, 1, 1, 1]])
    cache.record_plain_inputs(mask, generate_positions(mask), T)
    slot_ids = (100 * torch.arange(B)[:, None] + torch.arange(T)).float()  # [B, T]
    for layer in range(3):
        cache.update_conv_state(slot_ids[:, None, :].expand(B, D, T), layer)
        cache.update_recurrent_state(torch.ones(B, 4, 16, 16), layer)
    kv = slot_ids[:, None, :, None].expand(B, 1, T, 16)
    cache.update(kv, kv, 3)
    assert cache.lengths.tolist() == [4, 4, 4] and cache.positions.tolist() == [4, 2, 3]

    parents = torch.tensor([[-1, 0, 0, 1, 3], [-1, 0, 1, -1, -1], [-1, 0, 0, 0, 0]])
    N = parents.shape[1]
    node_ids = (1000 + 100 * torch.arange(B)[:, None] + torch.arange(N)).float()  # [B, N]
    tree_round = cache.new_round(parents)
    with cache.tree_mode(parents, tree_round) as (attention_mask, position_ids, tree_ancestors):
        depth = torch.tensor([[0, 1, 1, 2, 3], [0, 1, 2, 0, 0], [0, 1, 1, 1, 1]])
        torch.testing.assert_close(position_ids, cache.positions[:, None] + depth, rtol=0, atol=0)
        for b in range(B):
            for i in range(N):
                ancestors, j = set(), i
                while j >= 0:
                    ancestors.add(j)
                    j = int(parents[b, j])
                expected = [bool(mask[b, s]) if s < T else (s - T) in ancestors for s in range(cache.capacity)]
                assert attention_mask[b, 0, i].tolist() == expected
                assert tree_ancestors[b, i].tolist() == [j in ancestors for j in range(N)]
        kv = node_ids[:, None, :, None].expand(B, 1, N, 16)
        cache.update(kv, kv, 3)
        key = torch.zeros(B, N, 2, 16)
        key[..., 0] = 1  # every node writes only row 0 of the state, u = 2^i: the sum names the nodes
        u = (2.0 ** torch.arange(N))[None, :, None, None].expand(B, N, 4, 16)
        for layer in range(3):
            cache.update_conv_state(node_ids[:, None, :].expand(B, D, N), layer)
            state = GDNTreeState(use_qk_l2norm=False, key=key, u=u, log_decay=torch.zeros(B, N, 4))
            cache.update_recurrent_state(state, layer)
    paths = [[0, 1, 3, 4], [0, 1], []]
    cache.commit(tree_round, batch_trees([p or [-1] for p in paths]))

    assert cache.lengths.tolist() == [8, 6, 4] and cache.positions.tolist() == [8, 4, 3]
    keys = cache.layers[3].keys[:, 0, :, 0]  # [B, C]
    for b, path in enumerate(paths):
        expected_kv = slot_ids[b].tolist() + node_ids[b, path].tolist()
        assert keys[b, : T + len(path)].tolist() == expected_kv
        for layer in range(3):
            assert cache.layers[layer].conv_states[0][b, 0].tolist() == expected_kv[-W:]
            state = cache.layers[layer].recurrent_states[0][b]  # [H, K, V]
            assert (state[:, 0] == 1 + sum(2.0**j for j in path)).all() and (state[:, 1:] == 1).all()


@torch.no_grad()
def test_positions_follow_plain_forwards():
    """Tree positions continue whatever numbering the plain forwards used."""
    model = build_model()
    ids, mask = left_pad(PROMPTS)
    cache = BoleCache(model.config, batch_size=3)
    model(ids, attention_mask=mask, past_key_values=cache)  # the model numbers slots, padding included
    assert cache.positions.tolist() == cache.lengths.tolist() == [7, 7, 7]
    cache = BoleCache(model.config, batch_size=3)
    model(ids, attention_mask=mask, position_ids=generate_positions(mask), past_key_values=cache)
    assert cache.positions.tolist() == [7, 4, 1] and cache.lengths.tolist() == [7, 7, 7]
    step = dict(attention_mask=torch.ones(3, 8), position_ids=cache.positions[:, None].clone(), past_key_values=cache)
    model(torch.ones(3, 1, dtype=torch.int64), **step)  # a decode step as generate makes it
    assert cache.positions.tolist() == [8, 5, 2] and cache.lengths.tolist() == [8, 8, 8]


def test_capacity_grows_and_keeps_committed_state():
    model = build_model()
    cache = BoleCache(model.config, batch_size=3)
    prompts = [list(range(1, 61)), list(range(2, 40)), [7]]
    roots = prefill(model, cache, prompts)
    assert cache.capacity == 64
    keys = cache.layers[3].keys[:, :, :60].clone()
    parents = torch.tensor([[-1] + list(range(7))] * 3)
    tokens = torch.randint(1, VOCAB, parents.shape)
    tokens[:, 0] = roots
    tree_forward(model, cache, tokens, parents)  # 60 + 8 slots
    assert cache.capacity == 128
    torch.testing.assert_close(cache.layers[3].keys[:, :, :60], keys, rtol=0, atol=0)


def test_transient_bytes():
    model = build_model()
    N, B = 5, 3
    parents = torch.tensor([[-1, 0, 0, 1, 2]] * B)
    sizes = {}
    for verify in ("closed_form", "serial"):
        cache = BoleCache(model.config, batch_size=B)
        tokens = torch.randint(1, VOCAB, parents.shape)
        tokens[:, 0] = prefill(model, cache, PROMPTS)
        sizes[verify] = tree_forward(model, cache, tokens, parents, verify=verify).tree_round.transient_bytes
    NG, Hk, K, H, V, D = 3, 2, 16, 4, 16, 2 * 2 * 16 + 4 * 16
    assert sizes["closed_form"]["factors"] == 4 * NG * B * N * (Hk * K + H * V + H)
    assert sizes["serial"]["snapshots"] == 4 * NG * B * N * H * K * V
    for s in sizes.values():
        # every node's pre-conv input in every layer (the committed window is not copied)
        assert s["conv_inputs"] == 4 * NG * B * N * D and s["tree_kv"] == 4 * 2 * B * N * 16


@pytest.mark.parametrize("name", tiny_families.params(["kimi_linear", "bailing_hybrid-moe"]))
def test_kda_and_mla_state(name):
    """Kimi-Linear's and Bailing-Hybrid's state (their tiny models share sizes): MLA's compressed KV (one head: the
    latent as keys, the rotary key as values), KDA conv windows over q, k and v, and tree factors keeping g per key
    channel instead of a log-decay per head."""
    model = tiny_families.build(name)
    B, N = 3, 5
    cache = BoleCache(model.config, batch_size=B, max_cache_len=32)
    assert cache.layers[3].keys.shape == (B, 1, 32, 16) and cache.layers[3].values.shape == (B, 1, 32, 8)
    assert cache.layers[0].conv_states[0].shape == (B, 3 * 2 * 16, 4)
    assert cache.layers[0].recurrent_states[0].shape == (B, 2, 16, 16)
    parents = torch.tensor([[-1, 0, 0, 1, 2]] * B)
    tokens = torch.randint(1, VOCAB, parents.shape)
    tokens[:, 0] = prefill(model, cache, PROMPTS)
    sizes = tree_forward(model, cache, tokens, parents).tree_round.transient_bytes
    NG, H, K = 3, 2, 16
    assert sizes["factors"] == 4 * NG * B * N * (H * K + H * K + H * K)  # k, u and g
    assert sizes["tree_kv"] == 4 * B * N * (16 + 8)


@pytest.mark.parametrize("name", tiny_families.params(["glm5_next"]))
def test_glm5_next_indexer_state(name):
    """GLM-5-Next's NoPE MLA caches its latent and a zero-wide rotary key; its DSA indexer's packed token states
    (`[key, pooling gate logits, valid]`, 2 x 16 + 1 wide, valid where the prompt is) are kept for the layer with an
    indexer of its own, none for the "shared" layer after it; a tree round commits its path's as decoding it does."""
    model = tiny_families.build(name)
    cache = BoleCache(model.config, batch_size=3, max_cache_len=32)
    assert cache.layers[2].keys.shape == (3, 1, 32, 16) and cache.layers[2].values.shape == (3, 1, 32, 0)
    tokens = torch.randint(1, VOCAB, (3, 3))
    tokens[:, 0] = prefill(model, cache, PROMPTS)
    state = cache.state()
    assert set(state.index_keys) == {2} and state.index_keys[2].shape == (3, 7, 33)
    valid = torch.tensor([[0] * (7 - len(p)) + [1] * len(p) for p in PROMPTS], dtype=state.index_keys[2].dtype)
    assert torch.equal(state.index_keys[2][..., -1], valid)
    out = tree_forward(model, cache, tokens, torch.tensor([[-1, 0, 0]] * 3))
    cache.commit(out.tree_round, torch.tensor([[0, 2]] * 3))
    after = cache.state().index_keys[2]
    assert after.shape == (3, 9, 33) and torch.equal(after[:, :7], state.index_keys[2])
    plain = BoleCache(model.config, batch_size=3, max_cache_len=32)
    prefill(model, plain, PROMPTS)
    for token in (tokens[:, :1], tokens[:, 2:]):  # the accepted path decoded token by token
        model(token, past_key_values=plain)
    torch.testing.assert_close(after, plain.state().index_keys[2], atol=1e-5, rtol=1e-5)


def test_reset():
    model = build_model()
    cache = BoleCache(model.config, batch_size=3)
    first = prefill(model, cache, PROMPTS)
    cache.reset()
    assert cache.lengths.tolist() == [0, 0, 0]
    torch.testing.assert_close(prefill(model, cache, PROMPTS), first)


def test_errors():
    model = build_model()
    with pytest.raises(ValueError, match="LlamaConfig with layer_types"):
        BoleCache(LlamaConfig(), batch_size=1)
    with pytest.raises(ValueError, match="at least one of each"):
        BoleCache(text_config(layer_types=["full_attention"] * 4), batch_size=1)
    cache = BoleCache(model.config, batch_size=3, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="dtype=model.dtype"):
        prefill(model, cache, PROMPTS)

    cache = BoleCache(model.config, batch_size=3)
    prefill(model, cache, PROMPTS)
    parents = torch.tensor([[-1, 0, 0, 1]] * 3)
    with pytest.raises(ValueError, match="call tree_forward first"):
        cache.commit(cache.new_round(parents), torch.tensor([[0], [0], [0]]))  # never verified
    r = tree_forward(model, cache, torch.ones(3, 4, dtype=torch.int64), parents).tree_round
    with pytest.raises(ValueError, match="starts at the root"):
        cache.commit(r, torch.tensor([[1, 3], [0, 1], [0, 1]]))
    with pytest.raises(ValueError, match="follow parent links"):
        cache.commit(r, torch.tensor([[0, 2, 3], [0, 1, 3], [0, -1, -1]]))
    with pytest.raises(ValueError, match="at most N = 4"):
        cache.commit(r, torch.tensor([[0, 1, 3, -1, -1]] * 3))
    with pytest.raises(ValueError, match="right-padded"):
        cache.commit(r, torch.tensor([[0, -1, 1]] * 3))
    with pytest.raises(ValueError, match=r"B = 3"):
        cache.commit(r, torch.tensor([[0, 1]] * 2))
    cache.commit(r, torch.tensor([[0, 1, 3], [0, -1, -1], [0, 2, -1]]))
    with pytest.raises(ValueError, match="call tree_forward first"):
        cache.commit(r, torch.tensor([[0], [0], [0]]))  # committed once already
    with pytest.raises(ValueError, match="different lengths"):
        model(torch.ones(3, 1, dtype=torch.int64), past_key_values=cache)
    # transformers 5.25 passes how many states to keep
    with pytest.raises(NotImplementedError, match="does not record past states"):
        cache.activate_past_recording(recurrent_states_to_keep=1)
    r = tree_forward(model, cache, torch.ones(3, 4, dtype=torch.int64), parents).tree_round
    cache.reset()
    with pytest.raises(ValueError, match="call tree_forward first"):
        cache.commit(r, torch.tensor([[0], [0], [0]]))  # verified from a state the cache no longer holds


def test_commit_without_value_checks_reads_nothing(monkeypatch):
    """The decoding loop's commit (check_values=False) never reads the path on the host, so the host need not
    wait for the verify forward; the default checks the path."""
    model = build_model()
    cache = BoleCache(model.config, batch_size=3)
    prefill(model, cache, PROMPTS)
    parents = batch_trees([[-1, 0, 1], [-1, 0, 0], [-1, 0, 1]])
    r = tree_forward(model, cache, torch.ones_like(parents), parents).tree_round
    reads = []
    original = torch.Tensor.__bool__
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda self: reads.append(1) or original(self))
    cache.commit(r, batch_trees([[0, 1], [0, 2], [0]]), check_values=False)
    assert reads == []
    r = tree_forward(model, cache, torch.ones_like(parents), parents).tree_round
    with pytest.raises(ValueError, match="parent links"):
        cache.commit(r, batch_trees([[0, 2], [0, 2], [0]]))  # node 2 of row 0 hangs below node 1, not the root
    assert reads


@pytest.mark.skipif(torch.empty(0).device.type != "cpu", reason="the second device is cpu:1 (tests/generation on 2 GPUs)")
@pytest.mark.parametrize("verify", ["closed_form", "serial"])
def test_layers_on_two_devices(verify):
    """A model spread over two devices keeps each layer's state on its own device: one stacked set per device,
    committed per device, with the bookkeeping copied once per device and round. On CPU a second "device" cpu:1
    holds CPU tensors, reached only through copies: the rounds and commits must equal those of one device."""
    gen = torch.Generator().manual_seed(0)
    model = build_model(num_hidden_layers=8)  # lin lin lin full, twice
    first, second = torch.device("cpu"), torch.device("cpu", 1)
    layer_devices = [first] * 5 + [second] * 3
    spread = BoleCache(model.config, batch_size=3, layer_devices=layer_devices)
    single = BoleCache(model.config, batch_size=3)
    assert spread.devices == [first, second] and spread.device == first
    # [first: GDN 0, 1, 2, 4 and attention 3], [second: GDN 5, 6 and attention 7]
    assert [(g.keys.shape[0], g.conv.shape[0], g.recurrent.shape[0]) for g in spread._groups] == [(1, 4, 4), (1, 2, 2)]
    roots = prefill(model, spread, PROMPTS)
    assert torch.equal(roots, prefill(model, single, PROMPTS))
    for _ in range(6):
        trees, parents, tokens = _random_round(roots, gen)
        out = tree_forward(model, spread, tokens, parents, verify=verify)
        reference = tree_forward(model, single, tokens, parents, verify=verify)
        logits = out.logits
        torch.testing.assert_close(logits, reference.logits, rtol=0, atol=0)
        slots = [g.slots for g in out.tree_round.groups]
        assert torch.equal(slots[0], slots[1]) and slots[0].data_ptr() != slots[1].data_ptr()  # copied for cpu:1
        path = batch_trees([random_path(tree, gen) for tree in trees])
        spread.commit(out.tree_round, path)
        single.commit(reference.tree_round, path)
        roots = logits.gather(1, path.clamp(min=0).amax(1)[:, None, None].expand(-1, 1, VOCAB))[:, 0].argmax(-1)
        for got, want in zip(spread.layers, single.layers):
            if hasattr(want, "keys"):
                committed = torch.arange(single.capacity) < single.lengths[:, None]  # [B, C]
                for name in ("keys", "values"):  # [B, H, C, D]: slots past the committed ones hold scratch
                    kv = [getattr(layer, name).transpose(1, 2)[committed] for layer in (got, want)]
                    torch.testing.assert_close(*kv, rtol=0, atol=0)
            else:
                torch.testing.assert_close(got.conv_states[0], want.conv_states[0], rtol=0, atol=0)
                torch.testing.assert_close(got.recurrent_states[0], want.recurrent_states[0], rtol=0, atol=0)
    assert torch.equal(spread.lengths, single.lengths) and torch.equal(spread.positions, single.positions)


def test_layer_devices_errors():
    config = text_config()
    with pytest.raises(ValueError, match="a device per decoder layer: 4 of them, got 3"):
        BoleCache(config, batch_size=1, layer_devices=["cpu"] * 3)
    # a cache made for another placement: named at the first layer whose input is not where its state is (all on
    # the CPU, also where the tests' default device is a GPU)
    with torch.device("cpu"):
        model = build_model()  # lin lin lin full
        elsewhere = BoleCache(model.config, batch_size=len(PROMPTS), layer_devices=["cpu", "cpu", "meta", "meta"])
        expected = r"layer 2 runs on cpu, but this BoleCache keeps its state on meta; .*for_model"
        with pytest.raises(ValueError, match=expected):
            prefill(model, elsewhere, PROMPTS)
