"""CUDA graphs of the verify forward (`hf_bole.generation.graphs`): what capture relies on, checked on any device,
and replay against plain decoding on a GPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import hf_bole
from hf_bole import BoleCache
from hf_bole.generation import graphs as graphs_module
from hf_bole.generation.budget import synthetic_draft_tree
from hf_bole.generation.commit import TailGraphs, greedy_tail
from hf_bole.generation.graphs import KEPT_CAPACITY_STEP, ShapeGraphs
from hf_bole.generation.select import WIDTH_BUCKETS, SelectGraphs, prepared_tree, row_width, select_nodes, width_bucket
from hf_bole.generation.verify import graphed_cache, trimmed
from hf_bole.generation.tree import VerifyTree
from hf_bole.models import graph_unsafe_experts, tree_forward
from hf_bole.placement import Placement
from tests.generation.recorded_graph import recording_capture, recording_queued_capture
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


def test_width_bucket():
    assert [width_bucket(w, 128) for w in (1, 4, 5, 16, 17, 100, 128)] == [4, 4, 8, 16, 32, 128, 128]
    assert width_bucket(20, 24) == 24  # never wider than selection padded the trees
    assert WIDTH_BUCKETS[-1] == hf_bole.kernels.utils.MAX_TREE_NODES  # the kernels' largest tree


def test_row_width_holds_the_budget_in_a_bucket():
    """The smallest bucket whose rows hold the whole budget (root included), never wider than selection pads."""
    assert row_width(192, 8, 64) == 32  # 8 x 31 nodes hold 192
    assert row_width(248, 8, 64) == 32 and row_width(249, 8, 64) == 64
    assert row_width(64, 8, 64) == 16 and row_width(32, 8, 64) == 8
    assert row_width(32, 1, 64) == 64 and row_width(8, 1, 64) == 16  # one row: its budget's bucket
    assert row_width(500, 2, 64) == 64 and row_width(40, 1, 21) == 21  # at most the padded width
    assert row_width(0, 3, 64) == 4 and row_width(5, 0, 64) == 8  # roots only; no active row


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


@pytest.mark.parametrize("mode", ["closed_form", "serial"])
def test_replayed_tail_commits_as_the_eager_tail(monkeypatch, mode):
    """A greedy round's tail from graphs (a recorded call in place of a CUDA graph) over rounds whose trees and
    logits sit in the same buffers: the first call runs eagerly, the second captures, later ones replay with the
    rows that take part copied in; outputs and the committed state equal the eager tail's every round, and the host
    keeps a bound of the rows' lengths (`BoleCache.record_commit`)."""
    captured = []
    monkeypatch.setattr(graphs_module, "capture", recording_capture(captured))
    model = build_model()
    eager, replayed = (BoleCache(model.config, batch_size=3, max_cache_len=96) for _ in range(2))
    for cache in (eager, replayed):
        prefill(model, cache, PROMPTS)
    tails = TailGraphs(replayed)
    generator = torch.Generator().manual_seed(3)
    static = None  # the round's tree and logits, in the same buffers every round (the graphs' inputs)
    for active in ([True, True, True], [True, False, True], [True, False, True], [True, True, False]):
        active = torch.tensor(active, device=eager.device)
        tree = synthetic_draft_tree(3, 3, 3, generator)
        roots = torch.randint(1, 50, (3,), generator=generator, device=generator.device)
        verify = _cloned(select_nodes(tree, roots, 12, 6), eager.device)
        # Each node's token the target's choice at its parent where it can be: paths several nodes deep.
        for _ in range(2):
            out = tree_forward(model, eager, verify.input_ids, verify.parents, verify=mode)
            chosen = out.logits.argmax(-1).gather(1, verify.parents.clamp(min=0))
            verify.input_ids[:, 1:] = torch.where(verify.node_mask, chosen, 0)[:, 1:]
        out = tree_forward(model, eager, verify.input_ids, verify.parents, verify=mode)
        want = greedy_tail(eager, verify, out, active, 4, 4)
        # The forward fills the same round's buffers every round, as a verify graph does.
        kept_round = None if static is None else static[1].tree_round
        got_out = tree_forward(model, replayed, verify.input_ids, verify.parents, verify=mode, tree_round=kept_round)
        if static is None:
            static = [_cloned(verify), _cloned(got_out)]
        for buffer, value in zip(static, (verify, got_out)):
            for field in dataclasses.fields(value):
                if isinstance(getattr(value, field.name), torch.Tensor):
                    getattr(buffer, field.name).copy_(getattr(value, field.name))
        got = tails(*static, active, 4, 4)
        for field in dataclasses.fields(want):
            torch.testing.assert_close(getattr(got, field.name), getattr(want, field.name), rtol=0, atol=0)
        _assert_same_committed(replayed, eager)
        assert replayed._length_bound >= int(replayed.lengths.max())
    assert int(eager.lengths.max()) > 12  # some rounds accepted more than the root
    assert len(captured) == 1  # one key: the second call captured, the later ones replayed


@pytest.mark.skipif(not torch.empty(0).is_cuda, reason="CUDA graphs need a GPU (HF_BOLE_TEST_DEVICE=cuda)")
def test_shape_graphs_capture_behind_queued_work_in_one_pool():
    """`ShapeGraphs` made anew per call (as a `_Writes` is for a longer call): they capture while earlier work is still
    queued without waiting for it, replay what eager calls give (a running count updated in place), and share one memory
    pool across calls, so reserved memory stops growing."""
    count = torch.zeros(64, dtype=torch.long)
    expected = torch.zeros(64, dtype=torch.long)

    def run(x):
        count.add_(x)
        return count * 2

    reserved = []
    for call in range(12):
        graphs = ShapeGraphs(run)
        for step in range(4):
            x = torch.arange(64) + 100 * call + step
            busy = torch.randn(2048, 2048)
            torch.cuda.set_sync_debug_mode("error")  # a wait for the GPU raises
            try:
                for _ in range(4):  # queued work the capture need not wait for
                    busy = busy @ busy / 64
                out = graphs(x)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            expected += x
            assert torch.equal(out, expected * 2)
        reserved.append(torch.cuda.memory_reserved())
    assert reserved[-1] == reserved[2]


@pytest.mark.skipif(not torch.empty(0).is_cuda, reason="CUDA graphs need a GPU (HF_BOLE_TEST_DEVICE=cuda)")
@pytest.mark.parametrize("verify, kind", [("closed_form", "dense"), ("serial", "dense"), ("closed_form", "moe")])
def test_cuda_graphs_generate_matches_plain(verify, kind):
    """Greedy output with replayed verify forwards equals plain generate, over two calls that share the cache; a
    mixture of experts under transformers' batched_mm experts is captured too (grouped_mm only in bf16, whose
    near-ties would make this comparison flaky: the end-to-end runs of the 35B-A3B shape on a GPU cover it)."""
    model = build_model(kind)
    if kind == "moe":
        model.set_experts_implementation("batched_mm")
        assert graphs_module.captures(model, cuda_graphs=True)
    ids = torch.tensor([[0, 0, 5, 17, 33, 2], [71, 3, 28, 44, 9, 60], [0, 0, 0, 0, 0, 13]])
    mask = (ids != 0).long()
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=24, pad_token_id=0)
    expected = model.generate(ids, **kwargs)
    for _ in range(2):
        out = model.generate(
            ids, custom_generate="hf_bole", bole_drafter="ngram", bole_cuda_graphs=True, bole_verify=verify, **kwargs
        )
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
    # One row: its forward keeps its budget's width, without reading the widest row kept.
    one = {**kwargs, "attention_mask": mask[1:2]}
    single = model.generate(ids[1:2], custom_generate="hf_bole", bole_drafter="ngram", bole_verify=verify, **one)
    torch.testing.assert_close(single, model.generate(ids[1:2], **one), rtol=0, atol=0)


def test_eager_experts_are_not_captured(monkeypatch):
    """transformers' "eager" experts loop over the experts hit, reading the routing on the host, and so does torch's
    grouped_mm outside bf16: models (and MTP layers) running them verify and draft without graphs; "grouped_mm" (the
    default) in bf16 and "batched_mm" are captured."""
    moe = build_model("moe")
    assert not graph_unsafe_experts(build_model("dense"))
    gpus = [torch.device("cuda", 0), torch.device("cuda", 1)]
    cases = (
        ("grouped_mm", torch.bfloat16, False), ("grouped_mm", torch.float32, True),
        ("batched_mm", torch.float32, False), ("eager", torch.float32, True),
    )  # fmt: skip
    for implementation, dtype, unsafe in cases:
        moe.set_experts_implementation(implementation)
        moe.to(dtype)
        assert bool(graph_unsafe_experts(moe)) == unsafe
        if unsafe:
            assert implementation in graph_unsafe_experts(moe)[0]
        monkeypatch.setattr(graphs_module, "placement", lambda model: Placement(gpus[0], gpus[0], (gpus[0],) * 4))
        assert graphs_module.captures(moe, cuda_graphs=True) != unsafe
        # the experts blocks are found once per model; their implementation and dtype are read at every call
        monkeypatch.setattr(moe, "named_modules", lambda *a, **k: pytest.fail("modules walked again"))
        assert bool(graph_unsafe_experts(moe)) == unsafe
        # over two GPUs (device_map) never: a graph is captured on one device's stream
        monkeypatch.setattr(graphs_module, "placement", lambda model: Placement(gpus[0], gpus[1], (*gpus, *gpus)))
        assert not graphs_module.captures(moe, cuda_graphs=True)
        monkeypatch.undo()
    # what the "eager" experts would read while a graph captures (the reason they are refused)
    cache = BoleCache(moe.config, batch_size=3, max_cache_len=64)
    prefill(moe, cache, PROMPTS)
    parents = batch_trees([[-1, 0, 0, 1], [-1, 0, 1, 2], [-1, 0, 0, 0]])
    tree_forward(moe, cache, torch.ones_like(parents), parents)
    reads = []
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda self, _o=torch.Tensor.__bool__: reads.append(1) or _o(self))
    tree_forward(moe, cache, torch.ones_like(parents), parents)
    monkeypatch.undo()
    assert reads


def test_replayed_selection_reads_its_static_inputs(monkeypatch):
    """Selection from graphs (a recorded call in place of a CUDA graph): each call's trees reach the captured
    selection through its static buffers, one capture per (tree shape, dtype, budget, cap)."""
    captured = []
    monkeypatch.setattr(graphs_module, "capture", recording_capture(captured))
    select = SelectGraphs()
    generator = torch.Generator().manual_seed(0)
    for budget in (4, 4, 9, 4, 9):
        tree = synthetic_draft_tree(3, 3, 3, generator)
        roots = torch.randint(0, 50, (3,), generator=generator, device=generator.device)
        replayed, direct = select(tree, roots, budget, 7), select_nodes(tree, roots, budget, 7)
        for field in dataclasses.fields(direct):
            torch.testing.assert_close(getattr(replayed, field.name), getattr(direct, field.name), rtol=0, atol=0)
    assert len(captured) == 2  # budgets 4 and 9


def test_replayed_selection_prepares_the_tree_inside(monkeypatch):
    """The rows that are done and a custom drafter's tree made safe (`prepared_tree`) are part of the replayed
    selection: a tree with a token out of the vocabulary, too deep a node and a finished row selects as
    select_nodes does on the prepared tree, one capture per (budget, safe) whatever rows are active."""
    captured = []
    monkeypatch.setattr(graphs_module, "capture", recording_capture(captured))
    select = SelectGraphs()
    generator = torch.Generator().manual_seed(2)
    for active in ([True, False, True], [True, True, False], [True, False, True]):
        tree = synthetic_draft_tree(3, 3, 3, generator)
        tree.tokens[0, 1] = 10**6  # outside any vocabulary: clamped
        roots = torch.randint(0, 50, (3,), generator=generator, device=generator.device)
        active_t = torch.tensor(active, device=generator.device)
        for safe in ((50, 2), None):
            replayed = select(tree, roots, 6, 7, active_t, safe)
            direct = select_nodes(prepared_tree(tree, active_t, safe), roots, 6, 7)
            for field in dataclasses.fields(direct):
                torch.testing.assert_close(getattr(replayed, field.name), getattr(direct, field.name), rtol=0, atol=0)
        assert not bool(replayed.node_mask[~active_t, 1:].any())  # finished rows verify their root only
    assert len(captured) == 2  # made safe or not


def test_selection_reads_nothing_on_the_host(monkeypatch):
    """What capturing selection relies on: after the trees' one parents check, `select_nodes` reads nothing back."""
    tree = synthetic_draft_tree(3, 3, 3, torch.Generator().manual_seed(1))
    roots = torch.tensor([1, 2, 3])
    select_nodes(tree, roots, 6, 7)  # the parents check reads them here, once
    reads = []
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)
        record = lambda self, *a, _original=original, _name=name, **k: reads.append(_name) or _original(self, *a, **k)  # noqa: E731
        monkeypatch.setattr(torch.Tensor, name, record)
    select_nodes(tree, roots, 6, 7)
    monkeypatch.undo()
    assert reads == []
