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

from hf_bole.config import BoleConfig
from hf_bole.generation.requests import tensor_parallel_settings
from hf_bole.models.mtp import Qwen3_5MTP, save_pretrained_with_mtp
from hf_bole.placement import Placement
from hf_bole.tensor_parallel import TensorParallel, tensor_parallel
from tests import tensor_parallel_worker as worker
from tests.models import tiny, tiny_families

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


def _checkpoints(folder: Path) -> Path:
    for kind in KINDS:
        model = tiny.build_model(kind, **SHAPE)
        save_pretrained_with_mtp(model, Qwen3_5MTP.for_model(model), folder / kind)
    return folder


def _ranks(checkpoints: Path) -> list[dict]:
    """What each of the two ranks got (`--standalone`: a free port, beside any other test's ranks)."""
    out = checkpoints / "out.json"
    # The torch paths on the CPU, as the tests outside `interpreter` take them (`conftest.triton_mode`).
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "TRITON_INTERPRET": "0"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
               "tests.tensor_parallel_worker", str(checkpoints), str(out)]  # fmt: skip
    run = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-6000:]
    return [json.loads(out.with_name(f"out.{r}.json").read_text()) for r in range(2)]


def test_tensor_parallel(tmp_path):
    """One torchrun of two ranks (the costly part, so one test: pytest-xdist would start one per worker) checked
    against itself, plain `generate` under the same sharding, and one process."""
    checkpoints = _checkpoints(tmp_path)
    ranks = _ranks(checkpoints)
    # Every rank decodes the same tokens: drafts, selection, acceptance and sampling agree without an exchange.
    assert ranks[0] == ranks[1]
    got = ranks[0]
    assert got["key_value_heads"] == 1  # each rank attends with one of the two KV heads
    # a table keyed by the degree, of forwards launched from Python (on GPUs "tp2-triton-attention-eager")
    launch, grids = got["calibrated"]
    assert launch.startswith("tp2-") and launch.endswith("-eager") and grids == [[0, 1, 4]]  # the grid holds the floor
    assert "splits layer 0's (model.layers.0.linear_attn)" in got["split_gdn"]
    for kind in KINDS:
        runs = got[kind]
        for run in ("mtp", "oracle", "serial", "ngram_b1"):  # greedy: plain generate under the same sharding
            if run in runs:
                assert runs[run] == runs["plain"][: len(runs[run])], (kind, run)
        assert runs["oracle_accepted"] > 3, kind  # deep trees were accepted through the sharded attention
        model = AutoModelForCausalLM.from_pretrained(checkpoints / kind, dtype=torch.float32).eval()
        assert tensor_parallel(model).size == 1
        one = worker.generate(model, worker.PROMPTS, do_sample=False, custom_generate="hf_bole", bole_budget=16)
        assert runs["mtp"] == one == worker.generate(model, worker.PROMPTS, do_sample=False), kind
        assert "Seed every rank alike" in runs["unlike_seeds"]
        assert "bole_compile=True is not supported under tensor parallelism" in runs["compile"]


def test_other_families_refused():
    """Tensor parallelism runs on Qwen3.5: another family's plan places the heads otherwise (OLMo-Hybrid gathers its
    attention projections), so a sharded model of it is refused before any forward."""
    if not tiny_families.available("olmo_hybrid"):
        pytest.skip("OLMo-Hybrid is not in this transformers version")
    model = tiny_families.build("olmo_hybrid")
    cpu = torch.device("cpu")
    place = Placement(cpu, cpu, (cpu,) * len(model.model.layers))
    with pytest.raises(ValueError, match=r"tensor parallelism \(tp_plan\) on Qwen3.5 models; this OLMo-Hybrid model"):
        tensor_parallel_settings(model, BoleConfig(), TensorParallel(2, None, 1), place)
    one = tensor_parallel_settings(model, BoleConfig(), TensorParallel(1, None, 1), place)
    assert one == BoleConfig()  # not sharded: nothing to refuse
