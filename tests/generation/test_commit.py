"""Step 5, commit (`hf_bole.generation.commit`): a greedy round's tail replayed from a graph commits as the eager
tail does."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hf_bole import BoleCache
from hf_bole.generation import graphs as graphs_module
from hf_bole.generation.budget import synthetic_draft_tree
from hf_bole.generation.acceptance import Acceptance
from hf_bole.generation.commit import TailGraphs, cut_at_ends, greedy_tail
from hf_bole.generation.select import select_nodes
from hf_bole.models import tree_forward
from tests.generation.recorded_graph import recording_capture
from tests.generation.test_verify import _assert_same_committed, _cloned
from tests.models.tiny import build_model, prefill

PROMPTS = [[5, 17, 33, 2, 41, 9, 60], [71, 3, 28, 44], [13]]


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


def test_paths_stop_where_rows_end():
    """`cut_at_ends` keeps no node past a row's limit, nor past the parent of its first emitted EOS, which lowers the
    row's limit to end it there; tokens after a row's emitted ones (right padding) are not read."""
    path = torch.arange(5).expand(4, 5)  # every row accepted root -> 1 -> 2 -> 3 -> 4 and a bonus
    tokens = torch.tensor([[5, 6, 8, 9, 7], [5, 6, 8, 9, 3], [5, 7, 8, 7, 3], [5, 6, 8, 9, 7]])
    accepted = Acceptance(path=path, accept_lengths=torch.tensor([4, 5, 5, 5]), tokens=tokens,
                          bonus=tokens[:, -1], leaf=torch.full((4,), 4))  # fmt: skip
    lengths = torch.full((4,), 10)
    limits = torch.tensor([100, 12, 100, 100])
    cut = cut_at_ends(path.clone(), accepted, lengths, limits, torch.tensor([7]))
    # row 0: the EOS comes after its 4 emitted tokens; row 1: 2 slots left; row 2: EOS as its 2nd token, the cache
    # keeps root and 1; row 3: EOS as the bonus, the whole path
    assert cut.tolist() == [[0, 1, 2, 3, 4], [0, 1, -1, -1, -1], [0, 1, -1, -1, -1], [0, 1, 2, 3, 4]]
    assert limits.tolist() == [100, 12, 12, 15]
