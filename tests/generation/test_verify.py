"""Step 3, verify (`hf_bole.generation.verify`): the forward reads nothing on the host, its round is a value that
commits its own forward, and the verify graphs kept with their cache are captured again once it grew."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hf_bole import BoleCache
from hf_bole.generation import graphs as graphs_module
from hf_bole.generation.graphs import KEPT_CAPACITY_STEP
from hf_bole.generation.tree import VerifyTree
from hf_bole.generation.verify import graphed_cache, round_bytes, trimmed
from hf_bole.models import tree_forward
from tests.generation.recorded_graph import recording_capture, recording_queued_capture
from tests.models import tiny_families
from tests.models.tiny import batch_trees, build_model, prefill

PROMPTS = [[5, 17, 33, 2, 41, 9, 60], [71, 3, 28, 44], [13]]
HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")


@pytest.mark.parametrize(
    "verify, experts",
    [("closed_form", None), ("serial", None), ("closed_form", "grouped_mm"), ("closed_form", "batched_mm")],
)
def test_verify_forward_reads_nothing_on_the_host(monkeypatch, verify, experts):
    """A graph replays device work only: the verify forward must not read the device on the host, also once rows
    differ in length. (The parents check is the one read, made once per tree tensor and skipped while capturing.)
    So too a mixture-of-experts model under transformers' grouped or batched experts implementations."""
    model = build_model("moe" if experts else "dense")
    if experts:
        model.set_experts_implementation(experts)
    cache = BoleCache(model.config, batch_size=3, max_cache_len=64)
    prefill(model, cache, PROMPTS)
    parents = batch_trees([[-1, 0, 0, 1], [-1, 0, 1, 2], [-1, 0, 0, 0]])
    out = tree_forward(model, cache, torch.ones_like(parents), parents, verify=verify)
    cache.commit(out.tree_round, batch_trees([[0, 1, 3], [0], [0, 2]]))  # rows of different lengths from here on
    ids = torch.randint(1, 50, parents.shape)
    tree_forward(model, cache, ids, parents, verify=verify)  # the parents are checked (read) here, once
    reads = []
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)
        record = lambda self, *a, _original=original, _name=name, **k: reads.append(_name) or _original(self, *a, **k)  # noqa: E731
        monkeypatch.setattr(torch.Tensor, name, record)
    tree_forward(model, cache, ids, parents, verify=verify)
    monkeypatch.undo()
    assert reads == []


def test_trimmed_cuts_to_the_widest_row():
    parents = torch.full((3, 9), -1)
    widths = [3, 6, 1]
    for b, n in enumerate(widths):
        parents[b, 1:n] = torch.arange(n - 1)
    node_mask = torch.arange(9) < torch.tensor(widths)[:, None]
    depths = torch.where(node_mask, torch.arange(9), 0)
    verify = VerifyTree(torch.where(node_mask, 7, 0), parents, depths, torch.where(node_mask, torch.arange(9) - 1, -1),
                        node_mask, torch.tensor(widths))  # fmt: skip
    cut = trimmed(verify)
    assert cut.input_ids.shape == (3, 6) and torch.equal(cut.parents, parents[:, :6])


def test_graphed_cache_is_kept_and_grown():
    model = build_model()
    cache, graphs = graphed_cache(model, 3, 100, "closed_form")
    assert cache.capacity == KEPT_CAPACITY_STEP and graphs.cache is cache
    prefill(model, cache, PROMPTS)
    again, graphs_again = graphed_cache(model, 3, KEPT_CAPACITY_STEP, "closed_form")
    assert again is cache and graphs_again is graphs
    assert int(cache.lengths.sum()) == 0  # reset for the new call
    other, _ = graphed_cache(model, 3, 100, "serial")  # its own cache per verify mode
    assert other is not cache
    bigger, bigger_graphs = graphed_cache(model, 3, KEPT_CAPACITY_STEP + 1, "closed_form")  # grown in place
    assert bigger is cache and bigger.capacity == 2 * KEPT_CAPACITY_STEP and bigger_graphs is graphs


def test_graphs_are_captured_again_after_the_cache_grew(monkeypatch):
    """Trees that no longer fit grow the cache (new storage): every graph of it, which holds the old storage's
    addresses, is captured again (on a CPU a recorded call stands in for a CUDA graph); logits and commits stay the
    eager ones."""
    captured = []
    monkeypatch.setattr(graphs_module, "capture", recording_capture(captured))
    monkeypatch.setattr(graphs_module, "capture_queued", recording_queued_capture([]))
    monkeypatch.setattr(graphs_module, "KEPT_CAPACITY_STEP", 16)  # kept caches start as small as the eager one
    model = build_model()
    cache, graphs = graphed_cache(model, 3, 10, "closed_form")
    eager = BoleCache(model.config, batch_size=3)
    for c in (cache, eager):
        prefill(model, c, PROMPTS)
    parents = batch_trees([[-1, 0, 1, 2]] * 3)
    path = torch.tensor([[0, 1, 2, 3]] * 3)
    capacities = []
    for _ in range(32):  # 7 + 128 tokens: the cache's storage grows (in steps of 64 slots, doubling) twice
        ids = torch.randint(1, 50, parents.shape)
        before = len(captured)
        replayed, reference = graphs(ids, parents), tree_forward(model, eager, ids, parents)
        torch.testing.assert_close(replayed.logits, reference.logits)
        if cache.capacity not in capacities:  # grew: captured again
            capacities.append(cache.capacity)
            assert len(captured) == before + 1
        graphs.commit(replayed.tree_round, path)
        eager.commit(reference.tree_round, path)
    _assert_same_committed(cache, eager)
    assert capacities == [64, 128, 256]


def test_kept_round_commits_its_own_forward():
    """What replays rely on: after other widths' forwards, a forward given a width's kept round writes into that
    round's buffers (as its graph does), and committing it equals a commit right after a forward on a cache that
    never saw the other widths."""
    model = build_model()
    parents = batch_trees([[-1, 0, 0, 1], [-1, 0, 1, 2], [-1, 0, 0, 0]])
    ids = torch.randint(1, 50, parents.shape)
    path = batch_trees([[0, 1, 3], [0, 1], [0, 3]])
    direct, kept = (BoleCache(model.config, batch_size=3, max_cache_len=64) for _ in range(2))
    for cache in (direct, kept):
        prefill(model, cache, PROMPTS)
    reference = tree_forward(model, direct, ids, parents).tree_round
    tree_round = tree_forward(model, kept, ids, parents).tree_round
    wider = batch_trees([[-1, 0, 1, 2, 3, 4, 5, 6]] * 3)
    assert tree_forward(model, kept, torch.ones_like(wider), wider, tree_round=tree_round).tree_round is not tree_round
    assert tree_forward(model, kept, ids, parents, tree_round=tree_round).tree_round is tree_round
    direct.commit(reference, path)
    kept.commit(tree_round, path)
    _assert_same_committed(kept, direct)


def _assert_same_committed(got: BoleCache, want: BoleCache) -> None:
    """The two caches hold the same committed state, bit for bit (the slots past each row's length are scratch)."""
    for name in ("lengths", "positions"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=0, atol=0)
    (got_group,), (want_group,) = got._groups, want._groups  # one device: one group
    for name in ("conv", "recurrent"):
        torch.testing.assert_close(getattr(got_group, name), getattr(want_group, name), rtol=0, atol=0)
    committed = torch.arange(want.capacity) < want.lengths[:, None]  # [B, C]
    for name in ("keys", "values"):  # [layers, B, heads, C, dim]
        torch.testing.assert_close(
            getattr(got_group, name).transpose(2, 3)[:, committed],
            getattr(want_group, name).transpose(2, 3)[:, committed], rtol=0, atol=0,
        )  # fmt: skip


def _cloned(x, device=None):
    """A dataclass of tensors with every tensor field cloned (to `device`)."""
    fields = {f.name: getattr(x, f.name) for f in dataclasses.fields(x)}
    moved = {k: v.to(device, copy=True) for k, v in fields.items() if isinstance(v, torch.Tensor)}
    return dataclasses.replace(x, **moved)


@pytest.mark.parametrize("verify", ["closed_form", "serial"])
@pytest.mark.parametrize("width", [1, 2, 5, 16])
def test_round_bytes_is_what_a_round_allocates(verify, width):
    """`round_bytes`, the formula the docs' per-request memory comes from, against what a verify forward of a batch
    of 3 allocates: its tree round's state (`TreeRound.transient_bytes`) and its outputs, 3 times one request's."""
    model = build_model("dense")
    cache = BoleCache(model.config, batch_size=3, max_cache_len=64)
    prefill(model, cache, PROMPTS)
    parents = torch.arange(-1, width - 1).expand(3, -1)  # chains: any tree of the width allocates the same
    out = tree_forward(model, cache, torch.ones_like(parents), parents, verify=verify)
    expected = round_bytes(model.config, width, model.dtype, verify)
    outputs = {"logits": out.logits.nbytes, "hidden_states": out.hidden_states.nbytes}
    allocated = {**out.tree_round.transient_bytes, **outputs}
    assert allocated == {part: 3 * n for part, n in expected.items()}


@pytest.mark.parametrize("name", tiny_families.params())
def test_round_bytes_of_every_family(name):
    """The same for every family tree mode serves: KDA's log-decay per key channel, MLA's compressed KV, a sliding
    window's layers, the layouts `state_layout` reads (the prefill's choice of chains sizes a round with it)."""
    model = tiny_families.build(name)
    cache = BoleCache.for_model(model, 3)
    prefill(model, cache, PROMPTS)
    parents = torch.arange(-1, 4).expand(3, -1)
    out = tree_forward(model, cache, torch.ones_like(parents), parents)
    outputs = {"logits": out.logits.nbytes, "hidden_states": out.hidden_states.nbytes}
    allocated = {**out.tree_round.transient_bytes, **outputs}
    assert allocated == {part: 3 * n for part, n in round_bytes(model.config, 5, model.dtype).items()}
