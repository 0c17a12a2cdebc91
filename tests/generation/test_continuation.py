"""Continuing from a cache (`past_key_values=` / `cache=`): plain greedy's continuation from the same cache, the cache
handed back as plain `generate` leaves its own, shared prefixes, and clear errors for caches that cannot be
continued."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from packaging import version
import transformers
from transformers import DynamicCache, StaticCache, StoppingCriteria, StoppingCriteriaList

import hf_bole
from hf_bole import BoleCache
from hf_bole.cache.bole_cache import BoleAttentionLayer
from hf_bole.cache.state import read_dynamic
from hf_bole.generation import graphs, plan
from hf_bole.generation.drafters.mtp import MTPDrafter
from hf_bole.generation.prefill import unchainable
from tests.generation.test_loop import (  # noqa: F401
    PROMPTS,
    OracleDrafter,
    _char,
    _tokenizer,
    dense,
    dense_with_mtp,
    oracle_for,
)
from tests.models import tiny, tiny_families

# Compared with plain decoding in transformers' torch GDN path, also where fla-core would take over (see the fixture).
pytestmark = pytest.mark.usefixtures("torch_gdn")

NEW = 10
# fp32 states after a verify forward and after plain decoding sum in other orders (see tests/cache/test_bole_cache.py)
TOL = {"atol": 5e-5, "rtol": 5e-5}
SETTINGS = dict(do_sample=False, pad_token_id=0)


def plain(model, ids, mask, **kwargs):
    return model.generate(ids, attention_mask=mask, return_dict_in_generate=True, **SETTINGS, **kwargs)


def bole(model, ids, mask, **kwargs):
    kwargs.setdefault("custom_generate", "hf_bole")
    return model.generate(ids, attention_mask=mask, return_dict_in_generate=True, **SETTINGS, **kwargs)


def extend(sequences: torch.Tensor, mask: torch.Tensor, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The next turn's `(input_ids, attention_mask)`: the conversation so far (its generated tokens and the padding
    after a row's EOS are tokens, as plain decoding ran them) and `tokens` after every row."""
    new = torch.tensor([tokens] * sequences.shape[0])
    ids = torch.cat([sequences, new], dim=1)
    return ids, torch.cat([mask, torch.ones(ids.shape[0], ids.shape[1] - mask.shape[1], dtype=mask.dtype)], dim=1)


def oracle(model, ids, mask, new: int, **kwargs) -> OracleDrafter:
    """A drafter that knows plain greedy's continuation of `ids` from scratch (deep accepted paths)."""
    ref = plain(model, ids, mask, max_new_tokens=new + 8, **kwargs).sequences[:, ids.shape[1] :]
    return OracleDrafter([[0] * int(n) for n in mask.sum(-1)], ref.tolist())


def assert_holds_plain_state(cache, ref: DynamicCache) -> None:
    """`cache` (a BoleCache or a DynamicCache) holds what plain `generate`'s returned cache `ref` holds: as many slots,
    the same GDN states, and the same keys and values at every token (padding slots no query reads)."""
    state = cache.state() if isinstance(cache, BoleCache) else read_dynamic(cache, tiny.text_config())
    want = read_dynamic(ref, tiny.text_config())
    assert state.length == want.length
    tokens = state.valid if state.valid is not None else torch.ones(want.batch_size, want.length, dtype=torch.bool)
    for layer in want.keys:
        for got, expected in ((state.keys, want.keys), (state.values, want.values)):
            # [B, L, Hkv, Dh] at the tokens
            torch.testing.assert_close(got[layer].transpose(1, 2)[tokens], expected[layer].transpose(1, 2)[tokens],
                                       **TOL)  # fmt: skip
    for layer in want.conv:
        torch.testing.assert_close(state.conv[layer], want.conv[layer], **TOL)
        torch.testing.assert_close(state.recurrent[layer], want.recurrent[layer], **TOL)


@pytest.mark.parametrize("drafter", ["oracle", "mtp"])
@pytest.mark.parametrize("rows", [[0], [0, 1, 2]], ids=["B1", "B3"])
@pytest.mark.parametrize("source", ["plain", "bole"])
def test_continues_as_plain_generate_from_the_same_cache(dense_with_mtp, source, rows, drafter):
    """Turn 1 (plain `generate`, or hf_bole) stops row 0 at an EOS inside an accepted path, the others later: its
    returned cache is plain's (the stopped row holds its EOS and the padding after it). Turn 2 continues from it with
    hf_bole, exactly as plain `generate` continues from its own, and updates it in place; turn 3 continues the updated
    cache with plain `generate`, as from plain's."""
    model = dense_with_mtp
    ids, mask = tiny.left_pad([PROMPTS[r] for r in rows])
    probe = plain(model, ids, mask, max_new_tokens=NEW).sequences[:, ids.shape[1] :]
    eos = int(probe[0, 4])  # row 0 stops at its 5th token
    first = plain(model, ids, mask, max_new_tokens=NEW, eos_token_id=eos)
    if source == "bole":
        turn = bole(model, ids, mask, max_new_tokens=NEW, eos_token_id=eos, bole_budget=64,
                    bole_drafter=oracle(model, ids, mask, NEW))  # fmt: skip
        assert torch.equal(turn.sequences, first.sequences)
        assert_holds_plain_state(turn.past_key_values, first.past_key_values)
        cache = turn.past_key_values
    else:
        cache = copy.deepcopy(first.past_key_values)

    ids2, mask2 = extend(first.sequences, mask, [3, 4])
    ref = plain(model, ids2, mask2, max_new_tokens=NEW, past_key_values=copy.deepcopy(first.past_key_values))
    settings = dict(bole_depth=3) if drafter == "mtp" else dict(bole_drafter=oracle(model, ids2, mask2, NEW))
    out = bole(model, ids2, mask2, max_new_tokens=NEW, past_key_values=cache, bole_budget=64, **settings)
    assert torch.equal(out.sequences, ref.sequences)
    assert out.past_key_values is cache  # updated in place, as transformers updates a cache it is given
    assert_holds_plain_state(cache, ref.past_key_values)
    if drafter == "oracle":
        assert out.mean_accepted_tokens > 3.0

    ids3, mask3 = extend(ref.sequences, mask2, [5])
    again = plain(model, ids3, mask3, max_new_tokens=NEW, past_key_values=cache)
    want = plain(model, ids3, mask3, max_new_tokens=NEW, past_key_values=ref.past_key_values)
    assert torch.equal(again.sequences, want.sequences)


def test_the_returned_cache_stops_at_the_length_limit(dense):
    """Rows that run to max_new_tokens inside an accepted path: the cache holds the output minus its last token, as
    plain generate's does, and nothing of the path past it."""
    ids, mask = tiny.left_pad(PROMPTS[:3])
    ref = plain(dense, ids, mask, max_new_tokens=NEW)
    out = bole(dense, ids, mask, max_new_tokens=NEW, bole_drafter=oracle(dense, ids, mask, NEW), bole_budget=64)
    assert torch.equal(out.sequences, ref.sequences) and out.mean_accepted_tokens > 3.0
    assert out.past_key_values.lengths.tolist() == [ids.shape[1] + NEW - 1] * 3
    assert_holds_plain_state(out.past_key_values, ref.past_key_values)
    assert torch.equal(out.past_key_values.token_ids, ref.sequences[:, :-1])


@pytest.mark.parametrize("tails", ["ragged", "even"])
@pytest.mark.parametrize("source", ["forward", "bole"])
def test_a_shared_prefix(dense_with_mtp, source, tails):
    """One row's cache (a plain forward's over a system prompt, or an hf_bole call's) given to a batch whose rows
    all start with it after their left padding: the output of plain generate over the whole batch without a cache,
    and of each row alone from a copy of the cache; the shared cache is left as it was. Rows of different lengths are
    prefilled as chains (each row's own tokens), equal ones by the plain forward."""
    model = dense_with_mtp
    prefix = [5, 17, 33, 2, 41, 9, 60, 8]
    ends = [[71, 3, 28], [44], [13, 8, 90, 4, 4]] if tails == "ragged" else [[71, 3], [44, 9], [13, 8]]
    rows = [prefix + t for t in ends]
    ids, mask = tiny.left_pad(rows)
    one = torch.tensor([prefix])
    if source == "forward":
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(one, past_key_values=cache)
    else:  # a call of one new token returns a cache of the prompt (copied: with CUDA graphs the model's next call of
        # one row, below, would start the returned one afresh)
        out = bole(model, one, torch.ones_like(one), max_new_tokens=1, bole_drafter="ngram")
        cache = copy.deepcopy(out.past_key_values)
    kept = copy.deepcopy(cache)
    ref = plain(model, ids, mask, max_new_tokens=NEW)
    for drafter in ("ngram", "mtp"):
        out = bole(model, ids, mask, max_new_tokens=NEW, past_key_values=cache, bole_drafter=drafter, bole_depth=3)
        assert torch.equal(out.sequences, ref.sequences), drafter
        assert out.past_key_values is not cache and out.past_key_values.batch_size == 3
        alone = [bole(model, torch.tensor([r]), torch.ones(1, len(r), dtype=torch.long), max_new_tokens=NEW,
                      past_key_values=copy.deepcopy(kept), bole_drafter=drafter, bole_depth=3).sequences[0, len(r) :]
                 for r in rows]  # fmt: skip
        assert torch.equal(torch.stack(alone), ref.sequences[:, ids.shape[1] :]), drafter
    state, before = (
        c.state() if isinstance(c, BoleCache) else read_dynamic(c, tiny.text_config()) for c in (cache, kept)
    )
    assert state.length == before.length == len(prefix)
    for layer in before.keys:
        assert torch.equal(state.keys[layer], before.keys[layer])
    for layer in before.conv:
        assert torch.equal(state.recurrent[layer], before.recurrent[layer])


def test_the_mtp_drafter_sees_the_uncached_tokens(dense_with_mtp, monkeypatch):
    """A continued call's first draft is shown the hidden states of the uncached tokens only, at their positions in
    the conversation, and told how many cached tokens come before them (`unseen_prefix`): its entries start afresh
    from them, and it drafts what a new drafter shown those tokens alone drafts."""
    model = dense_with_mtp
    drafted = []
    propose = MTPDrafter.propose

    def recording(self, ctx):
        tree = propose(self, ctx)
        fields = ("hidden_states", "next_tokens", "new_mask", "positions", "lengths", "unseen_prefix")
        drafted.append(({name: getattr(ctx, name).clone() for name in fields}, ctx.max_nodes, ctx.max_length, tree))
        return tree

    monkeypatch.setattr(MTPDrafter, "propose", recording)
    ids, mask = tiny.left_pad(PROMPTS[:3])
    first = plain(model, ids, mask, max_new_tokens=NEW)
    ids2, mask2 = extend(first.sequences, mask, [3, 4])
    cached = first.sequences.shape[1] - 1
    # drafted as the drafter below drafts (on CUDA: neither compiled nor replayed, which could round a near-tie apart)
    bole(model, ids2, mask2, max_new_tokens=NEW, past_key_values=first.past_key_values, bole_depth=3,
         bole_compile_drafter=False, bole_cuda_graphs=False)  # fmt: skip
    ctx, max_nodes, max_length, tree = drafted[0]
    assert ctx["hidden_states"].shape[1] == ids2.shape[1] - cached
    assert ctx["unseen_prefix"].tolist() == mask2[:, :cached].sum(-1).tolist()
    assert ctx["positions"][:, 0].tolist() == ctx["unseen_prefix"].tolist()  # the first uncached token's position
    alone = dict(ctx, lengths=ctx["lengths"] - ctx["unseen_prefix"], unseen_prefix=None)
    fresh = MTPDrafter.from_model(model, depth=3, topk=4, fuse_projections=True)  # as the call's drafter
    again = propose(fresh, hf_bole.DraftContext(sequences=None, max_nodes=max_nodes, max_length=max_length, **alone))
    assert torch.equal(again.tokens, tree.tokens) and torch.equal(again.parents, tree.parents)


def test_graphed_calls_continue_the_kept_cache(dense, monkeypatch):
    """With CUDA graphs (recorded calls stand in for them on a CPU) the returned cache is the one kept for the next
    call of the batch size: passed back it is continued in place; a copy is copied in and updated; and once a later
    call has reused it for another conversation, continuing the first one from it is refused by name."""
    from tests.generation.recorded_graph import recording_capture, recording_queued_capture

    monkeypatch.setattr(plan, "captures", lambda model, cuda_graphs: True)
    monkeypatch.setattr(graphs, "capture", recording_capture([]))
    monkeypatch.setattr(graphs, "capture_queued", recording_queued_capture([]))
    monkeypatch.setattr(graphs, "KEPT_CAPACITY_STEP", 16)
    hf_bole.release(dense)
    ids, mask = tiny.left_pad(PROMPTS[:3])
    eos = int(plain(dense, ids, mask, max_new_tokens=NEW).sequences[1, ids.shape[1] + 3])
    first = plain(dense, ids, mask, max_new_tokens=NEW, eos_token_id=eos)
    settings = dict(max_new_tokens=NEW, bole_budget=64)
    turn = bole(dense, ids, mask, eos_token_id=eos, bole_drafter=oracle(dense, ids, mask, NEW), **settings)
    kept = turn.past_key_values
    assert torch.equal(turn.sequences, first.sequences)
    assert_holds_plain_state(kept, first.past_key_values)
    copied = copy.deepcopy(kept)

    ids2, mask2 = extend(first.sequences, mask, [3, 4])
    ref = plain(dense, ids2, mask2, max_new_tokens=NEW, past_key_values=copy.deepcopy(first.past_key_values))
    drafter = oracle(dense, ids2, mask2, NEW)
    for given in (kept, copied, copy.deepcopy(first.past_key_values)):
        out = bole(dense, ids2, mask2, past_key_values=given, bole_drafter=drafter, **settings)
        assert torch.equal(out.sequences, ref.sequences)
        assert out.past_key_values is given
        assert_holds_plain_state(given, ref.past_key_values)

    again = copy.deepcopy(copied)  # turn 2's cache
    bole(dense, *tiny.left_pad(PROMPTS[1:4]), max_new_tokens=NEW, bole_drafter="ngram")  # reuses the kept cache
    ids3, mask3 = extend(ref.sequences, mask2, [5])
    with pytest.raises(ValueError, match="input_ids do not start with the tokens this BoleCache holds"):
        bole(dense, ids3, mask3, past_key_values=kept, bole_drafter="ngram", max_new_tokens=NEW)
    out = bole(dense, ids3, mask3, past_key_values=again, bole_drafter="ngram", max_new_tokens=NEW)
    want = plain(dense, ids3, mask3, max_new_tokens=NEW, past_key_values=ref.past_key_values)
    assert torch.equal(out.sequences, want.sequences)


class StopAfter(StoppingCriteria):
    """Stops a row once its last token is `token` (a criterion the commit cannot see)."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def _stopped_in_a_round(dense, ids, mask, row: int = 0, stop: str = "criterion", **kwargs):
    """Settings under which `row` stops inside an accepted path, after the round committed it: a criterion on its 3rd
    token, or a stop string of its 2nd and 3rd (the oracle's rounds accept 5 tokens after the prefill's), and row 2 at
    an EOS; `kwargs` (position ids) go to every call."""
    probe = plain(dense, ids, mask, max_new_tokens=NEW, **kwargs).sequences[:, ids.shape[1] :]
    if stop == "criterion":
        stops = dict(stopping_criteria=StoppingCriteriaList([StopAfter(int(probe[row, 2]))]))
    else:
        stops = dict(stop_strings=["".join(_char(int(t)) for t in probe[row, 1:3])], tokenizer=_tokenizer())
    return dict(max_new_tokens=NEW, eos_token_id=int(probe[2, 8]), **stops, **kwargs)


def _rows_of(cache: BoleCache, rows: list[int], capacity: int) -> list[torch.Tensor]:
    """Copies of everything `cache` holds for `rows` in its first `capacity` slots."""
    index = torch.tensor(rows, dtype=torch.long, device=cache.device)
    held = [cache.lengths[index], cache.positions[index], cache.valid[index, :capacity]]
    for layer in cache.layers:
        if isinstance(layer, BoleAttentionLayer):
            held += [layer.keys[index, :, :capacity], layer.values[index, :, :capacity]]
        else:
            held += [layer.conv_states[0][index], layer.recurrent_states[0][index]]
    return held


@pytest.fixture
def refilled(monkeypatch) -> list[list[int]]:
    """The rows each `BoleCache.load_rows` rewrote (settle's prefill of stopped rows), each call checked to leave every
    other row bit for bit as it was."""
    calls = []
    load_rows = BoleCache.load_rows

    def checked(cache, rows, state, positions):
        others = [b for b in range(cache.batch_size) if b not in rows.tolist()]
        capacity = cache.capacity
        before = _rows_of(cache, others, capacity)
        load_rows(cache, rows, state, positions)
        for x, y in zip(before, _rows_of(cache, others, capacity)):
            assert torch.equal(x, y)
        calls.append(rows.tolist())

    monkeypatch.setattr(BoleCache, "load_rows", checked)
    return calls


def _continues_as_plain(dense, sequences, mask, cache, ref_cache, **kwargs) -> None:
    """Plain generate and hf_bole continuing the conversation `sequences` from `cache` (hf_bole's returned one) give
    plain generate's tokens from its own returned `ref_cache`."""
    ids2, mask2 = extend(sequences, mask, [3, 4])
    if "position_ids" in kwargs:  # the prompt's, numbered on over the tokens after it, as generate extends them
        given = kwargs["position_ids"]
        more = given[:, -1:] + 1 + torch.arange(ids2.shape[1] - given.shape[1])
        kwargs["position_ids"] = torch.cat([given, more], dim=1)
    ref = plain(dense, ids2, mask2, max_new_tokens=NEW, past_key_values=ref_cache, **kwargs)
    again = plain(dense, ids2, mask2, max_new_tokens=NEW, past_key_values=copy.deepcopy(cache), **kwargs)
    assert torch.equal(again.sequences, ref.sequences)
    out = bole(dense, ids2, mask2, max_new_tokens=NEW, past_key_values=cache, bole_drafter="ngram", **kwargs)
    assert torch.equal(out.sequences, ref.sequences)


@pytest.mark.parametrize("stop", ["criterion", "stop_string"])
@pytest.mark.parametrize("row", [0, 1], ids=["unpadded", "left-padded"])
def test_a_row_stopped_past_its_commit_is_prefilled_again(dense, caplog, refilled, row, stop):
    """A stopping criterion or a stop string that ends a row inside an accepted path, after the round committed it:
    that row alone is prefilled again, so the returned cache (and a DynamicCache passed in) holds what plain
    generate's does, without a warning, and plain generate and hf_bole continue it as plain generate continues its
    own."""
    ids, mask = tiny.left_pad(PROMPTS[:3])
    kwargs = _stopped_in_a_round(dense, ids, mask, row, stop)
    first = plain(dense, ids, mask, **kwargs)
    given = DynamicCache(config=dense.config)
    with caplog.at_level(logging.WARNING):
        out = bole(dense, ids, mask, past_key_values=given, bole_drafter=oracle(dense, ids, mask, NEW), bole_budget=64,
                   **kwargs)  # fmt: skip
    assert torch.equal(out.sequences, first.sequences)
    assert refilled == [[row]]
    assert not [r for r in caplog.records if r.name.startswith("hf_bole")]
    assert out.past_key_values is given
    assert_holds_plain_state(given, first.past_key_values)
    _continues_as_plain(dense, first.sequences, mask, given, first.past_key_values)


@pytest.mark.parametrize("cause", ["right-padded", "position-ids"])
def test_a_row_stopped_past_its_commit_whose_prompt_chains_cannot_run(dense, caplog, refilled, cause):
    """The same where the row's prompt is one chains through the verify forward cannot prefill as transformers'
    forward does: right padding (the forward runs it through the GDN layers, chains skip it), or position ids other
    than generate's own. The returned BoleCache holds every row, exactly as plain generate's, without a warning."""
    ids, mask = tiny.left_pad(PROMPTS[:3])
    settings = {}
    if cause == "right-padded":
        pads = (~mask.bool()).sum(-1)
        assert pads[1] > 0
        ids = torch.stack([row.roll(-int(p)) for row, p in zip(ids, pads)])  # each row's padding moved to its right
        mask = torch.stack([row.roll(-int(p)) for row, p in zip(mask, pads)])
    else:
        settings["position_ids"] = tiny.generate_positions(mask) + torch.tensor([[3], [7], [0]])
    assert unchainable(mask.bool(), settings.get("position_ids", tiny.generate_positions(mask))) is not None
    kwargs = _stopped_in_a_round(dense, ids, mask, row=1, **settings)
    first = plain(dense, ids, mask, **kwargs)
    with caplog.at_level(logging.WARNING):
        out = bole(dense, ids, mask, bole_drafter=oracle(dense, ids, mask, NEW, **settings), bole_budget=64, **kwargs)
    assert torch.equal(out.sequences, first.sequences)
    assert refilled == [[1]]
    assert not [r for r in caplog.records if r.name.startswith("hf_bole")]
    assert out.past_key_values.get_seq_length() == out.sequences.shape[1] - 1
    assert_holds_plain_state(out.past_key_values, first.past_key_values)
    _continues_as_plain(dense, first.sequences, mask, out.past_key_values, first.past_key_values, **settings)


def test_use_cache_false_returns_none(dense):
    """`use_cache=False` returns no cache (as plain generate), and refuses one passed in; a cache passed without
    `return_dict_in_generate` is updated all the same."""
    ids, mask = tiny.left_pad(PROMPTS[:2])
    out = bole(dense, ids, mask, max_new_tokens=3, use_cache=False, bole_drafter="ngram")
    assert out.past_key_values is None
    given = DynamicCache(config=dense.config)
    with pytest.raises(ValueError, match="use_cache=False asks generate for no cache, but one was passed"):
        bole(dense, ids, mask, max_new_tokens=3, use_cache=False, past_key_values=given, bole_drafter="ngram")
    sequences = dense.generate(ids, attention_mask=mask, max_new_tokens=3, past_key_values=given, **SETTINGS,
                               custom_generate="hf_bole", bole_drafter="ngram")  # fmt: skip
    assert given.get_seq_length() == sequences.shape[1] - 1


@pytest.mark.skipif(version.parse(transformers.__version__) < version.parse("5.25"), reason="output.cache from 5.25")
def test_the_output_holds_its_cache_by_its_new_name(dense, monkeypatch):
    """From transformers 5.25 the output's field is `cache`: built by the old name, every call returning a dict would
    log transformers' deprecation warning, which the caller never asked for."""
    from transformers.utils import generic

    said = []
    monkeypatch.setattr(generic.logger, "warning_once", lambda message, *args, **kwargs: said.append(message))
    ids, mask = tiny.left_pad(PROMPTS[:2])
    out = bole(dense, ids, mask, max_new_tokens=3, bole_drafter="ngram")
    assert not said and isinstance(out.cache, BoleCache)


@pytest.mark.skipif(version.parse(transformers.__version__) < version.parse("5.24"), reason="cache= from 5.24")
def test_cache_by_its_new_name(dense):
    """transformers 5.24's `cache=` is taken like `past_key_values=`."""
    ids, mask = tiny.left_pad(PROMPTS[:2])
    first = plain(dense, ids, mask, max_new_tokens=4)
    ids2, mask2 = extend(first.sequences, mask, [3])
    ref = plain(dense, ids2, mask2, max_new_tokens=4, cache=copy.deepcopy(first.past_key_values))
    out = bole(dense, ids2, mask2, max_new_tokens=4, cache=first.past_key_values, bole_drafter="ngram")
    assert torch.equal(out.sequences, ref.sequences) and out.past_key_values is first.past_key_values


@pytest.mark.parametrize("entry", ["name", "callable", "direct"])
def test_caches_that_cannot_be_continued_are_refused(dense, entry):
    """A ValueError that says what is wrong, before anything runs, by every entry point."""
    ids, mask = tiny.left_pad(PROMPTS[:3])
    config = dense.config

    def run(ids=ids, mask=mask, **kwargs):
        kwargs = {"max_new_tokens": 3, "bole_drafter": "ngram", **SETTINGS, **kwargs}
        if entry == "direct":
            return hf_bole.generate(dense, ids, attention_mask=mask, **kwargs)
        custom = "hf_bole" if entry == "name" else hf_bole.generate
        return dense.generate(ids, attention_mask=mask, custom_generate=custom, **kwargs)

    def filled(model, rows, length=4):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(ids[rows, :length].to(model.device), attention_mask=mask[rows, :length], past_key_values=cache)
        return cache

    good = filled(dense, slice(None))
    with pytest.raises(ValueError, match="a cache is passed twice, as cache= and past_key_values="):
        run(past_key_values=good, cache=good)
    with pytest.raises(ValueError, match="the cache holds 2 rows, but input_ids has 3"):
        run(past_key_values=filled(dense, slice(0, 2)))
    other = tiny.build_model(linear_num_value_heads=2)
    with pytest.raises(ValueError, match="layer 0 of the cache holds a state of shape .* a cache of another model"):
        run(past_key_values=filled(other, slice(None)))
    with pytest.raises(ValueError, match="holds torch.bfloat16, but the model runs in torch.float32"):
        run(past_key_values=filled(copy.deepcopy(dense).to(torch.bfloat16), slice(None)))
    with pytest.raises(ValueError, match="the cache holds 7 tokens but input_ids only 7"):
        run(past_key_values=filled(dense, slice(None), length=7))
    with pytest.raises(ValueError, match="continues from a BoleCache .* or a DynamicCache .* got a StaticCache"):
        run(past_key_values=StaticCache(config=config, max_cache_len=16))
    returned = run(return_dict_in_generate=True)
    ids2, mask2 = extend(returned.sequences, mask, [3])
    with pytest.raises(ValueError, match="marks as tokens slots the cache holds as padding"):
        run(ids2, torch.ones_like(mask2), past_key_values=returned.past_key_values)
    ids2[0, -3] += 1
    with pytest.raises(ValueError, match="input_ids do not start with the tokens this BoleCache holds"):
        run(ids2, mask2, past_key_values=returned.past_key_values)
    small = BoleCache(config, batch_size=3, max_cache_len=12)
    with pytest.raises(ValueError, match="max_cache_len=12 slots a row, but this call may need 13"):
        run(max_new_tokens=7, past_key_values=small)
    # A shared prefix: every row needs its tokens after its left padding, and one more.
    prefix = DynamicCache(config=config)
    with torch.no_grad():
        dense(torch.tensor([PROMPTS[0][:5]]), past_key_values=prefix)
    with pytest.raises(ValueError, match="holds the first 5 tokens of every row: each row needs those 5 tokens"):
        run(past_key_values=prefix)
    shared_ids, shared_mask = tiny.left_pad([PROMPTS[0][:5] + [3], PROMPTS[0][:5] + [4, 8]])
    for settings, reason in ((dict(bole_prefill="plain"), "bole_prefill='plain'"),
                             (dict(bole_verify="serial"), "verify='serial'")):  # fmt: skip
        with pytest.raises(ValueError, match=f"prefix shared by rows of different left padding .*{reason}"):
            run(shared_ids, shared_mask, past_key_values=prefix, **settings)
    # nothing ran: the model decodes as before
    assert torch.equal(run(), dense.generate(ids, attention_mask=mask, max_new_tokens=3, **SETTINGS))


@pytest.mark.parametrize("name", ["qwen4_exp", "glm5_next"])
def test_an_indexed_family_continues_as_plain_generate(name):
    """Qwen4-Exp's cache holds its QSA indexer's keys and the slots' positions too, GLM-5-Next's its DSA indexer's
    packed token states (no slot positions; none in its "shared" layer): hf_bole continues plain `generate`'s cache
    (three left-padded rows) exactly as plain `generate` does, updates it in place, and plain `generate` then
    continues the updated cache as its own."""
    if not tiny_families.available(name):
        pytest.skip(f"{name} needs transformers 5.24 on")
    model = tiny_families.build(name)
    ids, mask = tiny.left_pad(PROMPTS[:3])
    first = plain(model, ids, mask, max_new_tokens=NEW)
    ids2, mask2 = extend(first.sequences, mask, [3, 4])
    ref = plain(model, ids2, mask2, max_new_tokens=NEW, past_key_values=copy.deepcopy(first.past_key_values))
    cache = copy.deepcopy(first.past_key_values)
    drafter = oracle(model, ids2, mask2, NEW)
    out = bole(model, ids2, mask2, max_new_tokens=NEW, past_key_values=cache, bole_drafter=drafter)
    assert torch.equal(out.sequences, ref.sequences) and out.past_key_values is cache
    config = model.config.get_text_config(decoder=True)
    state, want = (read_dynamic(c, config) for c in (cache, ref.past_key_values))
    layer = {"qwen4_exp": 3, "glm5_next": 2}[name]  # the indexed layer whose indexer keeps a state
    assert set(state.index_keys) == set(want.index_keys) and layer in state.index_keys
    torch.testing.assert_close(state.index_keys[layer], want.index_keys[layer], **TOL)
    if name == "qwen4_exp":
        assert torch.equal(state.slot_positions, want.slot_positions)
    else:
        assert set(state.index_keys) == {2} and state.slot_positions is None
    ids3, mask3 = extend(ref.sequences, mask2, [5])
    again = plain(model, ids3, mask3, max_new_tokens=NEW, past_key_values=cache)
    expected = plain(model, ids3, mask3, max_new_tokens=NEW, past_key_values=ref.past_key_values)
    assert torch.equal(again.sequences, expected.sequences)
