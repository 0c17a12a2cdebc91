"""A cache's committed state in one form (`CacheState`): read from transformers' DynamicCache and from a BoleCache,
loaded into a BoleCache (shared prefixes at per-row offsets), written back into a DynamicCache, all exactly."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache, StaticCache

from hf_bole.cache import BoleCache
from hf_bole.cache.state import CacheState, read_dynamic, write_dynamic
from tests.models import tiny_families
from tests.models.tiny import build_model, generate_positions, left_pad, text_config

PROMPTS = [[5, 17, 33, 2, 41, 9, 60], [71, 3, 28, 44], [13]]


@pytest.fixture(scope="module")
def model():
    return build_model("dense")


@torch.no_grad()
def filled(model, prompts=PROMPTS) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
    """A DynamicCache after a plain forward over the left-padded `prompts`, and their ids and mask."""
    ids, mask = left_pad(prompts)
    cache = DynamicCache(config=model.config)
    model(ids, attention_mask=mask, position_ids=generate_positions(mask), past_key_values=cache)
    return cache, ids, mask


def assert_states_equal(a: CacheState, b: CacheState) -> None:
    assert a.length == b.length and set(a.keys) == set(b.keys) and set(a.conv) == set(b.conv)
    for x, y in ((a.keys, b.keys), (a.values, b.values), (a.conv, b.conv), (a.recurrent, b.recurrent)):
        for layer in x:
            assert torch.equal(x[layer], y[layer]), layer


@torch.no_grad()
def test_round_trip_through_a_bole_cache(model):
    """DynamicCache -> BoleCache -> DynamicCache leaves every tensor as it was, and the next token's logits from
    either cache are the same."""
    config = text_config()
    dynamic, ids, mask = filled(model)
    state = read_dynamic(dynamic, config)
    assert state.length == ids.shape[1] and state.valid is None and state.batch_size == 3
    cache = BoleCache.for_model(model, 3)
    cache.load(state, valid=mask.bool())
    held = cache.state()
    assert_states_equal(held, state)
    assert torch.equal(held.valid, mask.bool()) and cache.positions.tolist() == mask.sum(-1).tolist()
    back = DynamicCache(config=model.config)
    write_dynamic(held, back, config)
    assert_states_equal(read_dynamic(back, config), state)
    assert int(back.get_seq_length()) == state.length  # transformers 5.25 counts a GDN layer's tokens itself
    assert back.layers[3].keys.data_ptr() != cache.layers[3].keys.data_ptr()  # copies, not views
    nxt = torch.tensor([[7], [8], [9]])
    mask2 = torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], dim=1)
    positions = generate_positions(mask2)[:, -1:]
    logits = [model(nxt, attention_mask=mask2, position_ids=positions, past_key_values=c).logits for c in (cache, back)]
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-6, atol=1e-6)


def test_a_shared_prefix_lands_after_each_rows_padding(model):
    """A state of one row loaded into three rows at slots 0, 2 and 5: each row holds it after that much padding,
    numbered from 0."""
    state = read_dynamic(filled(model, PROMPTS[:1])[0], text_config())
    L = state.length
    cache = BoleCache.for_model(model, 3)
    cache.load(state, starts=[0, 2, 5])
    assert cache.lengths.tolist() == [L, L + 2, L + 5] and cache.positions.tolist() == [L] * 3
    for row, start in enumerate([0, 2, 5]):
        assert not cache.valid[row, :start].any() and cache.valid[row, start : start + L].all()
        assert torch.equal(cache.layers[3].keys[row, :, start : start + L], state.keys[3][0])
        assert torch.equal(cache.layers[0].recurrent_states[0][row], state.recurrent[0][0])
    with pytest.raises(ValueError, match="rows of this BoleCache hold different numbers of tokens"):
        cache.state()


def test_load_rows_rewrites_those_rows_alone(model):
    """A state of two rows loaded into rows 2 and 0 of a cache of three: those rows hold it exactly (slots, padding,
    lengths, next positions), longer than the rows the cache held; every tensor of row 1 is as it was, bit for bit."""
    config = text_config()
    dynamic, _, mask = filled(model)
    cache = BoleCache.for_model(model, 3)
    cache.load(read_dynamic(dynamic, config), valid=mask.bool())
    longer = [[4, 4, 90, 2, 8, 8, 31, 7, 7], [66, 1]]
    dynamic, _, mask = filled(model, longer)
    state = read_dynamic(dynamic, config)
    assert state.length > cache.get_seq_length()
    state.valid = mask.bool()
    kept = copy.deepcopy(cache)
    rows = torch.tensor([2, 0])
    cache.load_rows(rows, state, torch.tensor([11, 12]))
    L = state.length
    assert cache.lengths.tolist() == [L, kept.lengths[1], L] and cache.positions.tolist() == [12, kept.positions[1], 11]
    for i, b in enumerate(rows.tolist()):
        assert torch.equal(cache.valid[b, :L], state.valid[i]) and cache.valid[b, L:].all()
        for layer in state.keys:
            assert torch.equal(cache.layers[layer].keys[b, :, :L], state.keys[layer][i])
            assert torch.equal(cache.layers[layer].values[b, :, :L], state.values[layer][i])
        for layer in state.conv:
            assert torch.equal(cache.layers[layer].conv_states[0][b], state.conv[layer][i])
            assert torch.equal(cache.layers[layer].recurrent_states[0][b], state.recurrent[layer][i])
    C = kept.capacity
    assert torch.equal(cache.valid[1, :C], kept.valid[1])
    for layer in state.keys:
        assert torch.equal(cache.layers[layer].keys[1, :, :C], kept.layers[layer].keys[1])
        assert torch.equal(cache.layers[layer].values[1, :, :C], kept.layers[layer].values[1])
    for layer in state.conv:
        assert torch.equal(cache.layers[layer].conv_states[0][1], kept.layers[layer].conv_states[0][1])
        assert torch.equal(cache.layers[layer].recurrent_states[0][1], kept.layers[layer].recurrent_states[0][1])
    with pytest.raises(ValueError, match="load_rows writes 3 rows, so it needs a state of 3 rows"):
        cache.load_rows(torch.arange(3), state, torch.zeros(3, dtype=torch.long))


def test_pad(model):
    """Padding slots go after each row's slots, never attended, taking no position."""
    cache = BoleCache.for_model(model, 2)
    cache.pad(torch.tensor([3, 0]))
    assert cache.lengths.tolist() == [3, 0] and cache.positions.tolist() == [0, 0]
    assert cache.valid[0, :3].tolist() == [False] * 3 and cache.valid[1].all() and cache.valid[0, 3:].all()


def test_caches_of_another_model_are_refused(model):
    config = text_config()
    dynamic, _, _ = filled(model)
    state = read_dynamic(dynamic, config)
    cache = BoleCache.for_model(model, 3)
    with pytest.raises(ValueError, match="the cache holds 3 rows, but this call has 2"):
        BoleCache.for_model(model, 2).load(state)
    other = read_dynamic(filled(build_model(linear_key_head_dim=8))[0], text_config(linear_key_head_dim=8))
    with pytest.raises(ValueError, match="layer 0 of the cache holds a state of shape .*a cache of another model"):
        cache.load(other)
    half = copy.deepcopy(state)
    half.keys[3] = half.keys[3].half()
    with pytest.raises(ValueError, match="layer 3 of the cache holds torch.float16, but the model runs in torch.float"):
        cache.load(half)
    fewer = copy.deepcopy(state)
    del fewer.conv[2], fewer.recurrent[2]
    with pytest.raises(ValueError, match=r"GDN layers \[0, 1\], but this model's are .* \[0, 1, 2\]"):
        cache.load(fewer)
    with pytest.raises(ValueError, match="got a StaticCache"):
        read_dynamic(StaticCache(config=model.config, max_cache_len=8), config)
    with pytest.raises(ValueError, match="the cache has 4 layers but the model 8"):
        read_dynamic(dynamic, text_config(num_hidden_layers=8))
    dynamic.layers[0].record_past = True
    with pytest.raises(ValueError, match="records past states for transformers' assisted decoding"):
        read_dynamic(dynamic, config)


@torch.no_grad()
@pytest.mark.skipif(not tiny_families.available("qwen4_exp"), reason="Qwen4-Exp needs transformers 5.24 on")
def test_qwen4_exp_indexer_state_round_trip():
    """Qwen4-Exp's QSA indexer keys and the slots' positions go DynamicCache -> BoleCache -> DynamicCache unchanged,
    into rows of their own with `load_rows`, and the next token's logits from every cache are the same."""
    model = tiny_families.build("qwen4_exp")
    config = model.config
    dynamic, ids, mask = filled(model)
    state = read_dynamic(dynamic, config)
    L = state.length
    assert set(state.index_keys) == {3} and state.index_keys[3].shape == (3, L, 16)
    assert torch.equal(state.slot_positions, generate_positions(mask))
    cache = BoleCache.for_model(model, 3)
    cache.load(state, valid=mask.bool())
    held = cache.state()
    back = DynamicCache(config=model.config)
    write_dynamic(held, back, config)
    for other in (held, read_dynamic(back, config)):
        assert_states_equal(other, state)
        assert torch.equal(other.index_keys[3], state.index_keys[3])
        assert torch.equal(other.slot_positions, state.slot_positions)
    rows = BoleCache.for_model(model, 3)
    rows.load(read_dynamic(filled(model, [[4, 4, 90], [66, 1, 2], [8]])[0], config))
    rows.load_rows(torch.tensor([2, 0, 1]), CacheState(**{**vars(state), "valid": mask.bool()}), mask.sum(-1))
    for i, b in enumerate([2, 0, 1]):
        assert torch.equal(rows.state().index_keys[3][b], state.index_keys[3][i])
        assert torch.equal(rows.state().slot_positions[b], state.slot_positions[i])
    nxt = torch.tensor([[7], [8], [9]])
    mask2 = torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], dim=1)
    positions = generate_positions(mask2)[:, -1:]
    logits = [
        model(nxt, attention_mask=mask2, position_ids=positions, past_key_values=c).logits
        for c in (dynamic, cache, back)
    ]
    for other in logits[1:]:
        torch.testing.assert_close(other, logits[0], rtol=1e-6, atol=1e-6)
