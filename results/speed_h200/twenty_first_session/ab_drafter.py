"""The MTP drafter's round against its form before this session, in one process, passes taken in turns
(`eval/ab_turns.py`). Arguments: eval/run.py's (the first batch size; `bole` mode's depth, topk and compile).

    after   a round's steps attend by matmuls (`mtp_attention` with few_queries)
    before  SDPA (its memory-efficient kernel) in every step

Call 4 of the twenty-first session ran this script on `e41afd3`, whose `after` also took the top-k over the
vocabulary in 128-wide chunks (and `before` as now): that top-k was dropped after the run (README.md).

    python results/speed_h200/twenty_first_session/ab_drafter.py --datasets mbpp --num-prompts 8 \
        --max-new-tokens 128 --batch-sizes 8 --repeats 5

Each variant holds its own drafter (and so its own CUDA graphs), put in hf_bole's per-model slot before its passes.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from eval import ab_turns, run  # noqa: E402
from eval.modes import make_modes  # noqa: E402
from hf_bole.generation import loop  # noqa: E402
from hf_bole.generation.drafters.mtp import MTPDrafter  # noqa: E402


class Before(MTPDrafter):
    def _step(self, *args, few_queries):
        return super()._step(*args, few_queries=False)


def installing(cls, key):
    drafters = {}

    def install(model):
        if model not in drafters:
            depth, topk, graphs, compile = key
            drafters[model] = cls.from_model(model, depth=depth, topk=topk, cuda_graphs=graphs, compile=compile)
        loop._MTP_DRAFTERS.setdefault(model, {})[key] = drafters[model]
        return {}

    return install


if __name__ == "__main__":
    args = run.parse_args(sys.argv[1:])
    (mode,) = make_modes("bole", args.batch_sizes[0], args)
    key = (mode.depth, mode.topk, True, mode.compile)  # `_make_drafter`'s: depth, topk, cuda_graphs, compile
    ab_turns.main("drafter", {"after": installing(MTPDrafter, key), "before": installing(Before, key)}, sys.argv[1:])
