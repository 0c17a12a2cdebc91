"""This session's two drafter changes against their forms before, in one process, passes taken in turns
(`eval/ab_turns.py`). Arguments: eval/run.py's (the first batch size; `bole` mode's depth, topk and budget: a chain is
`--topk 1 --budget <depth x batch>`).

    now             the MTP head's q/k/v and gate/up as one GEMM each (`fuse_projections`), the attention merge in
                    chunks of splits for small tiles (`attention._merge_tiles`)
    merge before    the merge one split a step, 16 query rows (the rule before `fa33ca6`)
    apart           the head's projections one GEMM each (as before this session)
    before          both as before

Each variant holds its own drafter (and so its own compiled rounds and CUDA graphs), put in hf_bole's per-model slot
before its passes, and sets the merge's rule; the verify forward's graphs are shared, and at the house model's shapes
their attention merges one split a step under either rule.

    python results/speed_h200/thirty_seventh_session/ab_drafter.py --datasets mbpp --num-prompts 8 \
        --max-new-tokens 128 --batch-sizes 1 --depth 10 --repeats 8
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from eval import ab_turns, run
from eval.modes import make_modes
from hf_bole.generation import loop
from hf_bole.generation.drafters.mtp import MTPDrafter
from hf_bole.kernels import attention

CHUNKED = attention._merge_tiles


def one_split_a_step(M: int, block_d: int, num_splits: int) -> tuple[int, int]:
    return attention.MERGE_BLOCK_M, 1


def installing(key, fuse: bool, merge):
    drafters = {}

    def install(model):
        if model not in drafters:
            depth, topk, graphs, compile, _ = key
            drafters[model] = MTPDrafter.from_model(
                model, depth=depth, topk=topk, cuda_graphs=graphs, compile=compile, fuse_projections=fuse
            )
        loop._MTP_DRAFTERS.setdefault(model, {})[key] = drafters[model]
        attention._merge_tiles = merge
        return {}

    return install


if __name__ == "__main__":
    args = run.parse_args(sys.argv[1:])
    (mode,) = make_modes("bole", args.batch_sizes[0], args)
    compiled = mode.compile or torch.cuda.is_available()  # `_make_drafter`'s: compile_drafter is on by default
    key = (mode.depth, mode.topk, True, compiled, True)  # its key: depth, topk, cuda_graphs, compile, fuse_projections
    variants = {
        "now": installing(key, True, CHUNKED),
        "merge before": installing(key, True, one_split_a_step),
        "apart": installing(key, False, CHUNKED),
        "before": installing(key, False, one_split_a_step),
    }
    ab_turns.main("drafter", variants, sys.argv[1:], profile=False)
