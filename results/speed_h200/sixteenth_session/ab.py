"""This session's two changes, each against its absence, in one process, passes taken in turns (`eval/ab_turns.py`).
The first argument names the A/B; the rest are eval/run.py's.

    fuse      projections fused into one GEMM per group (`bole_fuse_projections=True`, the default) against one GEMM
              per projection (`False`); the model's weights are views of the fused buffers in both
    prefill   the prompt as chains through the verify forward's graphs (`bole_prefill="auto"`, the default) against
              transformers' forward over it (`"plain"`)

    python results/speed_h200/sixteenth_session/ab.py fuse --shape 9B --depth 6 --max-new-tokens 256 \
        --batch-sizes 1 --num-prompts 2 --repeats 7
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from eval import ab_turns  # noqa: E402

VARIANTS = {
    "fuse": {"fused": lambda model: {"bole_fuse_projections": True},
             "apart": lambda model: {"bole_fuse_projections": False}},
    "prefill": {"chains": lambda model: {"bole_prefill": "auto"},
                "plain": lambda model: {"bole_prefill": "plain"}},
}  # fmt: skip

if __name__ == "__main__":
    ab_turns.main(sys.argv[1], VARIANTS[sys.argv[1]], sys.argv[2:])
