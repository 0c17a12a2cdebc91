"""The prompt's prefill as chains through the verify forward: the cache and hidden states of transformers' forward."""

from __future__ import annotations

import functools

import pytest
import torch

from hf_bole.cache import BoleCache
from hf_bole.generation import graphs as graphs_module
from hf_bole.generation.commit import CommitGraphs
from hf_bole.generation.prefill import (
    CHAIN_PREFILL_ROUND_BYTES,
    chain_limit,
    chain_prefill,
    use_chains,
    weight_bytes,
)
from hf_bole.generation.verify import round_bytes
from hf_bole.models import tree_forward
from hf_bole.shapes import shape_config
from tests.generation.recorded_graph import recording_queued_capture
from tests.generation.test_verify import _assert_same_committed
from tests.models import tiny

pytestmark = pytest.mark.usefixtures("torch_gdn")


def long_prompts() -> list[list[int]]:
    """Ragged prompts over one, two and three chains of 128, left padding of up to 297 tokens."""
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(1, tiny.VOCAB, (n,), generator=gen, device="cpu").tolist() for n in (300, 5, 140, 1)]


@pytest.mark.parametrize("kind", ["dense", "moe"])
@torch.no_grad()
def test_chains_leave_the_cache_the_plain_forward_does(kind):
    model = tiny.build_model(kind)
    decoder = model.get_decoder()
    prompts = long_prompts()
    ids, mask = (x.to(model.device) for x in tiny.left_pad(prompts))
    B, P = ids.shape
    plain = BoleCache(model.config, batch_size=B)
    hidden = decoder(
        input_ids=ids, attention_mask=mask, position_ids=tiny.generate_positions(mask), past_key_values=plain
    ).last_hidden_state
    chains = BoleCache(model.config, batch_size=B, max_cache_len=P + 130)
    forward = functools.partial(tree_forward, model, chains)
    chained = chain_prefill(forward, chains, ids, mask.bool(), pad_token=0)
    real = mask.bool()
    torch.testing.assert_close(chained[real], hidden[real], atol=1e-4, rtol=1e-4)
    assert not chained[~real].any()  # left padding: zero
    assert chains.lengths.tolist() == [len(p) for p in prompts]  # the tokens, no padding slots
    for a, b in zip(plain.layers[:3], chains.layers[:3]):  # the GDN layers
        torch.testing.assert_close(b.recurrent_states[0], a.recurrent_states[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(b.conv_states[0], a.conv_states[0], atol=1e-5, rtol=1e-5)
    # The next token from either cache: a one-node tree of the same root gives the same logits.
    root = torch.randint(1, tiny.VOCAB, (B, 1))
    parents = torch.full((B, 1), -1)
    after = [tree_forward(model, cache, root, parents).logits for cache in (plain, chains)]
    torch.testing.assert_close(after[1], after[0], atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_replayed_chain_commits_leave_the_eager_cache(monkeypatch):
    """Chains committed by `CommitGraphs` (on a CPU a recorded call in place of a CUDA graph): the first chain of a
    width commits eagerly, the second captures, later ones replay with their path copied in; the cache and hidden
    states equal those of eager commits bit for bit, and the host keeps a bound of the rows' lengths."""
    if not torch.empty(0).is_cuda:
        monkeypatch.setattr(graphs_module, "capture_queued", recording_queued_capture([]))
    model = tiny.build_model("dense")
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, tiny.VOCAB, (n,), generator=gen, device="cpu").tolist() for n in (530, 7)]
    ids, mask = (x.to(model.device) for x in tiny.left_pad(prompts))
    B, P = ids.shape
    caches = [BoleCache(model.config, batch_size=B, max_cache_len=P + 130) for _ in range(2)]
    commits = [None, CommitGraphs(caches[1])]
    hidden = [
        chain_prefill(_round_per_width(model, cache), cache, ids, mask.bool(), 0, commit)
        for cache, commit in zip(caches, commits)
    ]
    torch.testing.assert_close(hidden[1], hidden[0], rtol=0, atol=0)
    _assert_same_committed(caches[1], caches[0])
    assert caches[1].lengths.tolist() == [530, 7]
    assert caches[1]._length_bound >= 530
    # chains of 128, 128, 128, 128 and 32 (18 tokens): one capture, at the second chain of 128
    assert len(commits[1]._graphs) == 1


def _round_per_width(model, cache):
    """`tree_forward` filling one round's buffers per tree width, as the verify graphs do."""
    rounds = {}

    def forward(ids, parents):
        out = tree_forward(model, cache, ids, parents, tree_round=rounds.get(ids.shape[1]))
        rounds[ids.shape[1]] = out.tree_round
        return out

    return forward


def test_which_prefill():
    nine_b, house = 18 * 10**9, 30 * 10**6  # weight bytes
    assert chain_limit(nine_b) == 512  # 4 chains: they beat one eager forward there, 8 did not
    assert chain_limit(4 * nine_b) == 512  # at least 4 chains, however large the model
    assert chain_limit(house) == 2400 * 128  # a small model re-reads little: long prompts as chains too
    small = 10**6  # a chain round's bytes for the whole batch
    assert use_chains("chains", graphed=False, prompt_length=5000, verify="closed_form", weight_bytes=nine_b,
                      round_bytes=100 * CHAIN_PREFILL_ROUND_BYTES)  # fmt: skip
    assert use_chains("auto", graphed=True, prompt_length=512, verify="closed_form", weight_bytes=nine_b,
                      round_bytes=small)  # fmt: skip
    assert not use_chains("auto", True, 513, "closed_form", nine_b, small)  # one forward reads the weights once
    assert use_chains("auto", True, 1024, "closed_form", house, small)
    assert not use_chains("auto", False, 8, "closed_form", house, small)  # launched from Python either way
    assert not use_chains("chains", True, 8, "serial", house, small)  # a snapshot per prompt token
    assert not use_chains("plain", True, 8, "closed_form", house, small)
    # the 9B shape's chain of 128 at batch 256 holds 47 GB of factors and logits: the plain forward instead
    chain = sum(round_bytes(shape_config("9B"), 128, torch.bfloat16).values())
    assert use_chains("auto", True, 128, "closed_form", nine_b, 16 * chain)
    assert not use_chains("auto", True, 128, "closed_form", nine_b, 256 * chain)

def test_weight_bytes_are_summed_once(monkeypatch):
    """The weights' bytes are summed at a model's first call and kept: the walk over its parameters is host time
    every `generate` call would pay again."""
    model = tiny.build_model("dense").to(torch.bfloat16)
    expected = sum(p.numel() for p in model.parameters()) * 2
    assert weight_bytes(model) == expected
    monkeypatch.setattr(model, "parameters", lambda *a, **k: pytest.fail("parameters walked again"))
    assert weight_bytes(model) == expected
