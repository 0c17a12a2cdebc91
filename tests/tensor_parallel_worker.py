"""One rank of `tests/test_tensor_parallel.py`: `torchrun --nproc-per-node 2 -m tests.tensor_parallel_worker <folder>
<out.json>` loads each tiny checkpoint of `<folder>` with `tp_plan="auto"` (gloo on the CPU), decodes plainly and with
hf_bole, and writes what it got as JSON (`<out.json>` with the rank before the suffix)."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor
from transformers import AutoModelForCausalLM
from transformers.utils import logging

import hf_bole  # noqa: F401  (registers custom_generate="hf_bole")
from eval.oracle import OracleDrafter
from hf_bole.generation.budget import calibrate
from hf_bole.tensor_parallel import tensor_parallel
from tests.models import tiny

PROMPTS = [[5, 17, 33, 2, 41, 9, 60], [71, 3, 28, 44], [13]]
NEW = 12


def generate(model, prompts, **kwargs):
    ids, mask = (t.to(model.device) for t in tiny.left_pad(prompts))
    kwargs.setdefault("max_new_tokens", NEW)
    return model.generate(ids, attention_mask=mask, pad_token_id=0, **kwargs).tolist()


def runs(model, kind: str) -> dict:
    """The tokens of every run this rank takes part in, by name (the serial verify and n-gram drafting: dense only)."""
    out = {"plain": generate(model, PROMPTS, do_sample=False)}
    # The oracle's trees hold the true continuation at most levels: deep accepted paths through sharded attention.
    longer = generate(model, PROMPTS, do_sample=False, max_new_tokens=NEW + 8)
    P = len(longer[0]) - NEW - 8
    oracle = OracleDrafter(
        [len(p) for p in PROMPTS], [row[P:] for row in longer], depth=4, topk=2, accept=0.8,
        vocab_size=model.config.vocab_size,
    )  # fmt: skip
    ids, mask = (t.to(model.device) for t in tiny.left_pad(PROMPTS))
    oracled = model.generate(
        ids, attention_mask=mask, pad_token_id=0, max_new_tokens=NEW, do_sample=False, custom_generate="hf_bole",
        bole_drafter=oracle, bole_budget=16, return_dict_in_generate=True,
    )  # fmt: skip
    out["oracle"], out["oracle_accepted"] = oracled.sequences.tolist(), oracled.mean_accepted_tokens
    out["mtp"] = generate(model, PROMPTS, do_sample=False, custom_generate="hf_bole", bole_budget=16)
    if kind == "dense":
        out["ngram_b1"] = generate(model, PROMPTS[:1], do_sample=False, custom_generate="hf_bole", bole_drafter="ngram")
        out["serial"] = generate(
            model, PROMPTS, do_sample=False, custom_generate="hf_bole", bole_verify="serial", bole_budget=16
        )  # fmt: skip
    torch.manual_seed(7)  # alike on every rank: the ranks sample alike
    out["sampled"] = generate(model, PROMPTS, do_sample=True, top_k=20, custom_generate="hf_bole", bole_budget=16)
    torch.manual_seed(7 + dist.get_rank())  # unlike
    try:
        generate(model, PROMPTS[:1], do_sample=True, custom_generate="hf_bole")
        out["unlike_seeds"] = "no error"
    except ValueError as e:
        out["unlike_seeds"] = str(e)
    try:
        generate(model, PROMPTS[:1], do_sample=False, custom_generate="hf_bole", bole_compile=True)
        out["compile"] = "no error"
    except ValueError as e:
        out["compile"] = str(e)
    return out


def main(folder: Path, out_path: Path) -> None:
    logging.set_verbosity_error()
    warnings.simplefilter("ignore", FutureWarning)  # tp_plan= in from_pretrained (5.24 asks for DistributedConfig)
    results = {}
    for kind in ("dense", "moe"):
        model = AutoModelForCausalLM.from_pretrained(folder / kind, tp_plan="auto", dtype=torch.float32).eval()
        results[kind] = runs(model, kind)
        if kind == "dense":  # the budget table of a tensor-parallel model: timed on every rank, keyed by the degree
            table = calibrate(model, [1], [8], [0, 4], warmup=1, reps=1, cuda_graphs=False)
            results["calibrated"] = [table.key.launch, [e.nodes for e in table.entries]]
    results["key_value_heads"] = tensor_parallel(model).key_value_heads
    # A plan that splits the GDN heads (their decays sharded) is refused.
    gdn = model.model.layers[0].linear_attn
    mesh = model.model.layers[3].self_attn.k_proj.weight.device_mesh
    gdn.A_log = torch.nn.Parameter(distribute_tensor(gdn.A_log.data, mesh, [Shard(0)]))
    try:
        tensor_parallel(model)
        results["split_gdn"] = "no error"
    except ValueError as e:
        results["split_gdn"] = str(e)
    out_path = out_path.with_name(f"{out_path.stem}.{dist.get_rank()}{out_path.suffix}")
    out_path.write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
