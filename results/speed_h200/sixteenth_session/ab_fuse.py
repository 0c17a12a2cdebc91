"""Projections fused into one GEMM per group (`bole_fuse_projections=True`, the default) against one GEMM per
projection (`False`), in one process, passes taken in turns (`eval/ab_turns.py`): both variants run on the same
model, whose weights are views of the fused buffers in both; only the verify forward's GEMMs differ. Takes
eval/run.py's arguments.

    python results/speed_h200/sixteenth_session/ab_fuse.py --shape 9B --depth 6 --max-new-tokens 256 \
        --batch-sizes 1 --num-prompts 2 --repeats 7
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from eval import ab_turns  # noqa: E402

if __name__ == "__main__":
    ab_turns.main("fuse", {"fused": lambda model: {"bole_fuse_projections": True},
                           "apart": lambda model: {"bole_fuse_projections": False}})  # fmt: skip
