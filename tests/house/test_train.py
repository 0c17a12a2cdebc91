"""The recipe end to end on a tiny shape: a checkpoint that transformers and hf_bole load like a real Qwen3.5 one."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_bole  # noqa: F401  (registers custom_generate="hf_bole")
from eval.house import evaluate, train
from hf_bole.models.mtp import Qwen3_5MTP
from tests.house.conftest import HOLDOUT


@pytest.fixture(scope="module")
def checkpoint(house_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("checkpoint")
    log = train.main([
        "--data", str(house_data), "--out", str(out), "--tiny", "--max-steps", "2", "--log-every", "1",
        "--sharegpt-file", str(house_data / "sharegpt.json"), "--sharegpt-holdout", str(HOLDOUT),
        "--python-root", str(house_data / "python"), "--eval-prompts", "0", "--device", "cpu",
    ])  # fmt: skip
    return out, log


def test_log_and_card(checkpoint):
    out, log = checkpoint
    assert log["training"]["steps"] == 2 and [s["step"] for s in log["steps"]] == [1, 2]
    assert set(log["heldout"]) == {"sharegpt", "gsm8k", "mbpp"}
    assert len(log["heldout"]["mbpp"]["mtp_agree"]) == 3  # --tiny unrolls 3 steps
    assert json.loads((out / "training_log.json").read_text())["training"] == log["training"]
    card = (out / "README.md").read_text()
    assert "## Held-out text" in card and "python -m eval.house.train" in card


def test_checkpoint_layout(checkpoint):
    out, _ = checkpoint
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForCausalLM"] and config["mtp_num_hidden_layers"] == 1
    assert config["dtype"] == "bfloat16" and config["tie_word_embeddings"]
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [0, 2]
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template and tok.padding_side == "left"


def test_loads_and_decodes_like_plain_generate(checkpoint):
    out, _ = checkpoint
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    mtp = Qwen3_5MTP.from_pretrained(model)  # the loader hf_bole's MTP drafter uses
    assert mtp.fc.weight.shape == (64, 128)
    tok = AutoTokenizer.from_pretrained(out)
    prompts = ["Question: Tom has 2 apples and buys 5 more. How many apples does he have?\nAnswer:", "def add_1(x):"]
    plain, prompt_len = evaluate.greedy_generate(model, tok, prompts, 10, min_new_tokens=10)
    bole = evaluate.bole_acceptance(model, tok, prompts, plain, 10, {"tree": {"bole_topk": 2, "bole_depth": 3}})
    assert bole["tree"]["rows_equal_to_plain_greedy"] == "2/2"
    assert bole["tree"]["mean_accepted_tokens"] >= 1
    own = evaluate.self_generated_metrics(model, mtp, tok, prompts, plain, prompt_len, [0, 2], depth=3)
    assert own["positions"] == 2 * 10 and 1 <= own["chain_accepted"] <= own["tree_top4_accepted_estimate"] <= 6


def test_replay():
    # roots 0..5 accept 2, -, -, 0, 1, -: rounds at roots 0 (3 tokens), 3 (1 token), 4 (2 tokens)
    assert evaluate._replay([2, 9, 9, 0, 1, 9]) == (6, 3)
