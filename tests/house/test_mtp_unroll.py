"""The unrolled MTP training forward computes exactly what hf_bole's MTP drafter computes at draft time."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from eval.house.mtp_unroll import forward_unrolled, mtp_unroll, unrolled_mask
from hf_bole.generation.drafters.base import DraftContext
from hf_bole.generation.drafters.mtp import MTPDrafter
from hf_bole.models.mtp import Qwen3_5MTP

VOCAB, DEPTH = 61, 4


@pytest.fixture(scope="module")
def model_and_mtp():
    torch.manual_seed(0)
    config = Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, attn_implementation="sdpa",
    )  # fmt: skip
    model = Qwen3_5ForCausalLM(config).eval()
    mtp = Qwen3_5MTP.for_model(model).eval()
    with torch.no_grad():
        # peaked draft distributions, so the drafter's argmax is far from ties
        model.get_input_embeddings().weight.normal_()
        model.lm_head.weight.normal_(std=0.5)
        for p in mtp.parameters():
            p.normal_(std=0.2)
    return model, mtp


def test_unrolled_mask():
    mask = unrolled_mask(3, 3, torch.device("cpu"))[0, 0].int()
    expected = [[1, 0, 0, 1, 0, 0, 1, 0, 0], [1, 1, 0, 0, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 1, 0, 0, 1]]
    assert mask.tolist() == expected


@pytest.mark.parametrize("root", [3, 9])
@torch.no_grad()
def test_matches_drafter_chain(model_and_mtp, root):
    """A top-1 chain drafted from root entry `root` (tokens d_1..d_D) is what the unrolled head predicts at index
    `root` when it is fed those tokens: the same argmax and the same log-probabilities at every depth."""
    model, mtp = model_and_mtp
    prefix = torch.randint(VOCAB, (1, root + 2))  # x_0 .. x_{root+1}; entry j is (h_j, x_{j+1}), the root is x_{root+1}
    hidden = model.get_decoder()(input_ids=prefix).last_hidden_state
    drafter = MTPDrafter.from_model(
        model, depth=DEPTH, topk=1, state_dict={f"mtp.{k}": v for k, v in mtp.state_dict().items()}
    )
    ctx = DraftContext(
        sequences=[prefix[0]], max_nodes=DEPTH, hidden_states=hidden[:, : root + 1], next_tokens=prefix[:, 1:]
    )
    tree = drafter.propose(ctx)
    assert tree.parents[0].tolist() == [-1, 0, 1, 2]  # a chain, shallowest first
    drafted = tree.tokens  # [1, D]

    # the sequence the unrolled head is teacher-forced on, with tokens of the text after the drafted ones
    tokens = torch.cat([prefix, drafted, torch.randint(VOCAB, (1, 3))], dim=1)
    length = root + 3  # indices past the root see nothing of it (causal), so extra ones change nothing there
    full_hidden = model.get_decoder()(input_ids=tokens).last_hidden_state
    outputs = mtp_unroll(
        mtp, model.get_input_embeddings(), model.get_decoder().rotary_emb, full_hidden[:, :length], tokens, DEPTH
    )
    log_probs = torch.stack([model.lm_head(o[0, root]).log_softmax(-1) for o in outputs])  # [D, V]
    assert log_probs.argmax(-1).tolist() == drafted[0].tolist()
    torch.testing.assert_close(log_probs.gather(1, drafted.T)[:, 0], tree.draft_logprobs[0], rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_forward_unrolled_shapes(model_and_mtp):
    model, mtp = model_and_mtp
    inputs = torch.randint(VOCAB, (2, 20))
    logits, mtp_logits = forward_unrolled(model, mtp, inputs, DEPTH)
    assert logits.shape == (2, 20, VOCAB)
    assert [tuple(m.shape) for m in mtp_logits] == [(2, 20 - DEPTH, VOCAB)] * DEPTH
    torch.testing.assert_close(logits, model(inputs).logits)
