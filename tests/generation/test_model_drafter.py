"""The small-model drafter (`assistant_model=` / `bole_drafter=<model>`): its trees against the drafter model's own
token-by-token decoding, and `generate` with it against plain `generate`."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import hf_bole
from hf_bole.generation.drafters.base import DraftContext
from hf_bole.generation.drafters.model import ModelDrafter
from tests.generation import sampling
from tests.generation.test_loop import PROMPTS, bole, plain
from tests.models import tiny, tiny_families

pytestmark = pytest.mark.usefixtures("torch_gdn")

NEW = 14


def llama(vocab_size: int = tiny.VOCAB, attn: str = "sdpa") -> LlamaForCausalLM:
    """A tiny random transformer drafter (GQA, two layers)."""
    torch.manual_seed(1)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, pad_token_id=0, initializer_range=0.1,
    )  # fmt: skip
    config._attn_implementation = attn
    return LlamaForCausalLM(config).eval()


def hybrid(vocab_size: int = tiny.VOCAB) -> torch.nn.Module:
    """A tiny random Qwen3.5 drafter, smaller than the target."""
    return tiny.build_model("dense", hidden_size=32, vocab_size=vocab_size)


DRAFTERS = {"llama": llama, "llama-eager": lambda: llama(attn="eager"), "qwen3_5": hybrid}


@torch.no_grad()
def _sequential_logprobs(model, ids: list[int]) -> torch.Tensor:
    """`[vocab]` the drafter's own next-token log-probabilities after `ids`, decoded plainly."""
    return model(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_propose_matches_sequential(drafter):
    """Two calls, the second after rows grew by different numbers of tokens: every node's draft log-probability is
    the drafter's own after the node's row and path, every level's children are the top-k of their parent, and the
    kept nodes are the best by cumulative probability (a prefix-closed tree)."""
    model = DRAFTERS[drafter]()
    target = tiny.build_model("dense")
    drafter = ModelDrafter(model, target, depth=3, topk=3)
    rows = [list(p) for p in PROMPTS[:3]]
    for grow in ([], [[7, 8], [9], [10, 11, 12]]):
        rows = [r + g for r, g in zip(rows, grow)] if grow else rows
        ctx = DraftContext(sequences=[torch.tensor(r) for r in rows], max_nodes=12)
        tree = drafter.propose(ctx)
        tree.validate(batch_size=3, vocab_size=tiny.VOCAB)
        assert tree.num_nodes == 12
        cum = tree.cumulative_logprobs()
        for b, row in enumerate(rows):
            parents, tokens = tree.parents[b].tolist(), tree.tokens[b].tolist()
            for i, (parent, token) in enumerate(zip(parents, tokens)):
                path = [tokens[j] for j in tiny.path_to(parents, parent)] if parent >= 0 else []
                ref = _sequential_logprobs(model, row + path)
                torch.testing.assert_close(tree.draft_logprobs[b, i], ref[token], atol=1e-4, rtol=1e-4)
                assert token in ref.topk(3).indices.tolist()  # a top-k child of its parent
            assert (cum[b, 1:] <= cum[b, :-1] + 1e-6).all()  # best first


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_rounds_without_a_draft_take_the_tokens_in(drafter):
    """A round that verifies no draft (`max_nodes` 0) gets an empty tree and still takes in the rows' new tokens: the
    next round's tree equals a fresh drafter's on the same rows. With 1 node a row only the best child is drafted."""
    model, target = DRAFTERS[drafter](), tiny.build_model("dense")
    rows = [list(p) for p in PROMPTS[:3]]
    grown = [r + g for r, g in zip(rows, ([7, 8], [9], [10, 11, 12]))]
    kept = ModelDrafter(model, target, depth=3, topk=3)
    empty = kept.propose(DraftContext(sequences=[torch.tensor(r) for r in rows], max_nodes=0))
    assert empty.tokens.shape == empty.parents.shape == empty.draft_logprobs.shape == (3, 0)
    for max_nodes in (12, 1):
        ctx = DraftContext(sequences=[torch.tensor(r) for r in grown], max_nodes=max_nodes)
        fresh = ModelDrafter(model, target, depth=3, topk=3).propose(ctx)
        tree = kept.propose(ctx)
        assert tree.num_nodes == max_nodes
        assert torch.equal(tree.tokens, fresh.tokens) and torch.equal(tree.parents, fresh.parents)
        torch.testing.assert_close(tree.draft_logprobs, fresh.draft_logprobs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("drafter", list(DRAFTERS))
@pytest.mark.parametrize("entry", ["name", "callable"])
def test_greedy_matches_plain(drafter, entry):
    """Three left-padded prompts: the output is plain greedy `generate`'s, by `assistant_model=` through both entry
    points (transformers 5.17-5.24 refuse assisted decoding of stateful models, 5.25 runs its own: hf_bole takes
    the call over in each)."""
    target = tiny.build_model("dense")
    prompts = PROMPTS[:3]
    ref = plain(target, prompts, max_new_tokens=NEW, do_sample=False)
    custom = "hf_bole" if entry == "name" else hf_bole.generate
    out = bole(
        target, prompts, max_new_tokens=NEW, do_sample=False, assistant_model=DRAFTERS[drafter](),
        custom_generate=custom, return_dict_in_generate=True,
    )  # fmt: skip
    assert torch.equal(out.sequences, ref)


@pytest.mark.parametrize(
    "name",
    tiny_families.params(
        ["qwen3_next-moe", "olmo_hybrid", "lara_mini", "kimi_linear", "bailing_hybrid-moe", "qwen4_exp", "glm5_next"]
    ),
)
def test_drafts_for_every_family(name):
    """A model of each family with a small drafter (`bole_drafter=<model>`), greedy."""
    target = tiny_families.build(name)
    ref = plain(target, PROMPTS[:3], max_new_tokens=NEW, do_sample=False)
    out = bole(target, PROMPTS[:3], max_new_tokens=NEW, do_sample=False, bole_drafter=llama())
    assert torch.equal(out, ref)


@pytest.mark.parametrize("name", tiny_families.params(["kimi_linear", "bailing_hybrid-moe", "glm5_next"]))
def test_a_kda_model_drafts_for_itself(name):
    """A KDA model (Kimi-Linear, Bailing-Hybrid, GLM-5-Next) as its own drafter (a chain, topk 1): the drafter's KDA
    states follow the accepted paths through its own tree rounds, so every drafted token and the bonus are accepted
    every round."""
    target = tiny_families.build(name)
    ref = plain(target, PROMPTS[:3], max_new_tokens=4 * 6 + 1, do_sample=False)
    out = bole(
        target, PROMPTS[:3], max_new_tokens=4 * 6 + 1, do_sample=False, assistant_model=target, bole_topk=1,
        return_dict_in_generate=True,
    )  # fmt: skip
    assert torch.equal(out.sequences, ref)
    assert (out.accept_lengths == 6).all()  # depth 5 and the bonus, 4 rounds


def test_the_drafter_state_follows_the_accepted_paths():
    """The target drafting for itself as a chain (topk 1) accepts every drafted token and the bonus every round: the
    hybrid drafter's state after each round is the committed text's (rolled back past the tree nodes it never
    committed), or its drafts would stray. (The transformer drafter's state: `test_propose_matches_sequential`.)"""
    target = tiny.build_model("dense")
    prompts = PROMPTS[:3]
    ref = plain(target, prompts, max_new_tokens=4 * 6 + 1, do_sample=False)
    out = bole(
        target, prompts, max_new_tokens=4 * 6 + 1, do_sample=False, assistant_model=target, bole_topk=1,
        return_dict_in_generate=True,
    )  # fmt: skip
    assert torch.equal(out.sequences, ref)
    assert (out.accept_lengths == 6).all()  # depth 5 and the bonus, 4 rounds


def test_sampling_keeps_the_distribution():
    """Chi-square: the joint law of the first three sampled tokens equals plain sampling's (4000 samples each), the
    tree drafted by a small model every round."""
    torch.manual_seed(0)
    model = tiny.build_model("dense", vocab_size=6)
    p_value = sampling.sampling_p_value(model, assistant_model=llama(6))
    assert p_value > 1e-3, f"sampling with a small-model drafter differs from plain sampling (p = {p_value:.2e})"


def test_drafters_refused():
    """A drafter of another vocabulary, of sliding-window layers, of an attention that takes no 4D mask, or named
    twice gets a ValueError saying why, before anything runs."""
    target = tiny.build_model("dense")
    prompts = PROMPTS[:1]
    with pytest.raises(ValueError, match="predicts 101 tokens and the target 97.*share the target's tokenizer"):
        bole(target, prompts, max_new_tokens=3, assistant_model=llama(101))
    sliding = Qwen2ForCausalLM(
        Qwen2Config(vocab_size=tiny.VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=32, use_sliding_window=True, sliding_window=4, max_window_layers=0)
    ).eval()  # fmt: skip
    with pytest.raises(ValueError, match="layers are all full attention.*sliding_attention"):
        bole(target, prompts, max_new_tokens=3, assistant_model=sliding)
    flash = llama()
    flash.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="attn_implementation='flash_attention_2'"):
        bole(target, prompts, max_new_tokens=3, assistant_model=flash)
    with pytest.raises(ValueError, match="assistant_model= and bole_drafter= both name a drafter"):
        bole(target, prompts, max_new_tokens=3, assistant_model=llama(), bole_drafter=llama())
    with pytest.raises(ValueError, match="topk \\* \\(depth - 1\\) = 130"):
        bole(target, prompts, max_new_tokens=3, assistant_model=llama(), bole_topk=10, bole_depth=14)
