"""NgramDrafter: prompt lookup grown into a trie of continuations."""

from __future__ import annotations

import math
import time

import pytest
import torch

from hf_bole.config import BoleConfig
from hf_bole.generation import DraftContext, NgramDrafter, select_nodes


def _propose(seqs, max_nodes=32, **config) -> tuple:
    drafter = NgramDrafter(BoleConfig(drafter="ngram", **config))
    tree = drafter.propose(DraftContext(sequences=[torch.tensor(s) for s in seqs], max_nodes=max_nodes))
    tree.validate(batch_size=len(seqs))
    return tree


def _paths(tree, b: int) -> dict[tuple[int, ...], float]:
    """Row b as {token path from the root: draft log-prob of its last edge}."""
    paths: list[tuple[int, ...]] = []
    out = {}
    rows = zip(tree.tokens[b].tolist(), tree.parents[b].tolist(), tree.draft_logprobs[b].tolist())
    for i, (t, p, lp) in enumerate(rows):
        if lp == -math.inf:
            paths.append(())
            continue
        paths.append((paths[p] if p >= 0 else ()) + (t,))
        out[paths[i]] = lp
    return out


def test_ngram_branches_from_two_occurrences():
    # suffix "7 8 9" occurred at 0 (followed by 1 7 8 9 2) and at 4 (followed by 2 7 8 9): two branches, the
    # more recent first, each root edge log(1/2), every deeper edge log(1)
    tree = _propose([[7, 8, 9, 1, 7, 8, 9, 2, 7, 8, 9]])
    assert tree.tokens.tolist() == [[2, 1, 7, 7, 8, 8, 9, 9, 2]]
    assert tree.parents.tolist() == [[-1, -1, 0, 1, 2, 3, 4, 5, 7]]
    assert tree.draft_logprobs[0, :2].tolist() == pytest.approx([math.log(0.5)] * 2)
    assert tree.draft_logprobs[0, 2:].tolist() == [0.0] * 7


def test_ngram_counts_give_draft_probabilities():
    # the suffix "8 3 4" never occurred, "3 4" three times: followed by 5 6, 5 7 and 9 0 (most recent last).
    # Trie: 5 (2/3) -> 6 (1/2), 7 (1/2); 9 (1/3) -> 0 (1)
    seq = [3, 4, 5, 6, 1, 3, 4, 5, 7, 2, 3, 4, 9, 0, 8, 3, 4]
    tree = _propose([seq], depth=2)
    paths = _paths(tree, 0)
    assert set(paths) == {(5,), (9,), (5, 7), (5, 6), (9, 0)}
    assert paths[(5,)] == pytest.approx(math.log(2 / 3)) and paths[(9,)] == pytest.approx(math.log(1 / 3))
    assert paths[(5, 6)] == pytest.approx(math.log(1 / 2)) and paths[(9, 0)] == 0.0
    # breadth-first, most frequent first, ties to the more recent occurrence: 5, 9 | 0, 7, 6
    assert tree.tokens.tolist() == [[5, 9, 0, 7, 6]]


def test_ngram_longest_suffix_wins_and_falls_back():
    # "1 2 3" occurred once (followed by 4); "3" alone also occurred followed by 8: the 3-gram wins
    tree = _propose([[3, 8, 1, 2, 3, 4, 1, 2, 3]], depth=1)
    assert _paths(tree, 0) == {(4,): 0.0}
    # no 3-, 2-gram repeats; the 1-gram "6" occurred once before, followed by 5
    tree = _propose([[6, 5, 1, 2, 6]], depth=1)
    assert _paths(tree, 0) == {(5,): 0.0}
    # ngram_min_size=2 forbids that fallback
    tree = _propose([[6, 5, 1, 2, 6]], depth=1, ngram_min_size=2, ngram_max_size=3)
    assert tree.tokens.shape == (1, 0)


def test_ngram_ragged_batch_and_no_match():
    # row 0 repeats, row 1 never does (padding only), row 2 is a single token
    tree = _propose([[1, 2, 3, 1, 2], [1, 2, 3, 4], [5]], depth=3)
    assert _paths(tree, 0) == {(3,): 0.0, (3, 1): 0.0, (3, 1, 2): 0.0}
    assert _paths(tree, 1) == {} and _paths(tree, 2) == {}
    assert tree.draft_logprobs[1].tolist() == [-math.inf] * 3


def test_ngram_respects_topk_depth_and_max_nodes():
    # suffix "0" is followed by 1..6 at different places: 6 root children, capped to topk = 3 (the most recent
    # three, as counts tie); depth 2 lets each grow one more token
    seq = [0, 1, 9, 0, 2, 9, 0, 3, 9, 0, 4, 9, 0, 5, 9, 0, 6, 9, 0]
    tree = _propose([seq], topk=3, depth=2)
    assert {p[0] for p in _paths(tree, 0)} == {6, 5, 4}
    assert max(len(p) for p in _paths(tree, 0)) == 2
    tree = _propose([seq], topk=3, depth=2, max_nodes=4)
    assert tree.tokens.shape == (1, 4)
    assert set(_paths(tree, 0)) == {(6,), (5,), (4,), (6, 9)}  # root children first (shallower on ties)


def test_ngram_follows_a_repeated_passage():
    torch.manual_seed(0)
    passage = torch.randint(0, 500, (40,)).tolist()
    seq = passage + [7] + passage[:10]
    tree = _propose([seq], depth=5)
    # the passage continues with passage[10:15]: the best path of the trie spells it
    vt = select_nodes(tree, torch.tensor([seq[-1]]), budget=5, max_nodes_per_row=127)
    assert vt.input_ids[0, 1:].tolist() == passage[10:15]


def test_ngram_deterministic_and_valid_on_random_sequences():
    g = torch.Generator(torch.get_default_device()).manual_seed(3)
    seqs = [torch.randint(0, 6, (int(n),), generator=g).tolist() for n in torch.randint(1, 300, (8,), generator=g)]
    first = _propose(seqs, max_nodes=20, depth=4, topk=3)
    second = _propose(seqs, max_nodes=20, depth=4, topk=3)
    assert torch.equal(first.tokens, second.tokens) and torch.equal(first.draft_logprobs, second.draft_logprobs)
    assert first.tokens.shape[1] <= 20
    assert (first.depths()[first.node_mask] < 4).all()
    assert first.node_mask.sum(-1).gt(0).sum() >= 6  # most rows of a 6-token alphabet find a repeat


def test_ngram_long_repetitive_sequence_is_fast():
    seq = torch.tensor([1, 2, 3] * 20000)  # 60k tokens, every suffix repeats thousands of times
    start = time.perf_counter()
    tree = NgramDrafter().propose(DraftContext(sequences=[seq] * 4, max_nodes=64))
    assert time.perf_counter() - start < 1.0
    assert tree.tokens[0, :5].tolist() == [1, 2, 3, 1, 2]  # one chain: every occurrence continues alike
