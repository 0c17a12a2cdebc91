"""Tensor parallelism (transformers' `tp_plan="auto"`): two ranks under torchrun (gloo on the CPU, NCCL on two GPUs)
decode tiny checkpoints (`tests/tensor_parallel_worker.py`), compared with each other and with one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from hf_bole.models.mtp import Qwen3_5MTP, save_pretrained_with_mtp
from hf_bole.tensor_parallel import tensor_parallel
from tests import tensor_parallel_worker as worker
from tests.models import tiny

REPO = Path(__file__).resolve().parents[1]
KINDS = ("dense", "moe")
# Two ranks split 4 query and 2 KV heads; transformers 5.17 gathers a colwise LM head only over an even vocabulary.
SHAPE = dict(vocab_size=96, num_attention_heads=4, num_key_value_heads=2)

# transformers' TP puts the ranks on the accelerator when there is one: one GPU each (NCCL), else the CPU (gloo).
pytestmark = [
    pytest.mark.skipif(
        not dist.is_available() or not dist.is_gloo_available() or torch.empty(0).device.type != "cpu",
        reason="two gloo ranks on the CPU need torch.distributed with gloo",
    ),
    pytest.mark.skipif(
        torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="two ranks on GPUs need two GPUs"
    ),
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tp")
    for kind in KINDS:
        model = tiny.build_model(kind, **SHAPE)
        save_pretrained_with_mtp(model, Qwen3_5MTP.for_model(model), folder / kind)
    return folder


@pytest.fixture(scope="module")
def ranks(checkpoints) -> list[dict]:
    """What each of the two ranks got."""
    out = checkpoints / "out.json"
    # The torch paths on the CPU, as the tests outside `interpreter` take them (`conftest.triton_mode`).
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "TRITON_INTERPRET": "0"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m",
               "tests.tensor_parallel_worker", str(checkpoints), str(out)]  # fmt: skip
    run = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-6000:]
    return [json.loads(out.with_name(f"out.{r}.json").read_text()) for r in range(2)]


def test_ranks_agree(ranks):
    """Every rank decodes the same tokens: drafts, selection, acceptance and sampling agree without an exchange."""
    assert ranks[0] == ranks[1]
    assert ranks[0]["key_value_heads"] == 1  # each rank attends with one of the two KV heads


def test_calibration_keyed_by_degree(ranks):
    assert ranks[0]["calibrated"] == ["tp2-eager", [[0, 1, 4]]]  # the grid holds the floor too (1 node)


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_matches_plain_tensor_parallel(ranks, kind):
    got = ranks[0][kind]
    for run in ("mtp", "oracle", "serial", "ngram_b1"):
        if run in got:
            assert got[run] == got["plain"][: len(got[run])], run
    assert got["oracle_accepted"] > 3  # deep trees were accepted through the sharded attention


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_matches_one_process(checkpoints, ranks, kind):
    model = AutoModelForCausalLM.from_pretrained(checkpoints / kind, dtype=torch.float32).eval()
    assert tensor_parallel(model).size == 1
    one = worker.generate(model, worker.PROMPTS, do_sample=False, custom_generate="hf_bole", bole_budget=16)
    assert ranks[0][kind]["mtp"] == one == worker.generate(model, worker.PROMPTS, do_sample=False)


@pytest.mark.parametrize("kind", KINDS)
def test_refusals(ranks, kind):
    got = ranks[0][kind]
    assert "Seed every rank alike" in got["unlike_seeds"]
    assert "bole_compile=True is not supported under tensor parallelism" in got["compile"]
    assert "splits layer 0's (model.layers.0.linear_attn)" in ranks[0]["split_gdn"]
