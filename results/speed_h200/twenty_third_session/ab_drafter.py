"""The MTP drafter's rounds compiled (`bole_compile_drafter`, the default on CUDA) against eager, for bole,
tree-serial and chain, in one process, passes in turns (`eval/ab_turns.py`). Arguments: eval/run.py's.

    python results/speed_h200/twenty_third_session/ab_drafter.py --datasets mbpp --num-prompts 8 \\
        --max-new-tokens 128 --batch-sizes 8 --repeats 5

Drafting was about half of a house round at batch 8 (2.9 of 5.8 ms, the twenty-second session): five MTP steps, each
a decoder layer's kernels launched one by one inside the drafter's CUDA graph, 35 RMSNorms of about ten kernels each.
A compiled round fuses them. Drafts only propose, so every variant's output must still equal plain greedy's (up to
bf16 near-ties at batch 8, as before).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from eval import ab_turns, run  # noqa: E402
from eval.modes import CHAIN_DEPTH  # noqa: E402

if __name__ == "__main__":
    B = run.parse_args(sys.argv[1:]).batch_sizes[0]
    chain = {"bole_depth": CHAIN_DEPTH, "bole_topk": 1, "bole_budget": CHAIN_DEPTH * B}
    serial = {"bole_verify": "serial"}
    variants = {}
    for name, settings in (("bole", {}), ("tree-serial", serial), ("chain", chain)):
        variants[name] = lambda model, s=settings: {**s, "bole_compile_drafter": False}
        variants[name + " cd"] = lambda model, s=settings: dict(s)
    ab_turns.main("drafter", variants, sys.argv[1:])
