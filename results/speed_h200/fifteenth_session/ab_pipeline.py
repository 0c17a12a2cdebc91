"""Pipelined rounds (`bole_pipeline=True`, the default) against rounds one after the other (`False`), in one process,
passes taken in turns (`eval/ab_turns.py`): both variants run on the same graphs and cache; only `bole_pipeline`
differs. Takes eval/run.py's arguments.

    python results/speed_h200/fifteenth_session/ab_pipeline.py --shape 9B --depth 6 --max-new-tokens 128 \
        --batch-sizes 1 --num-prompts 2 --repeats 7
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from eval import ab_turns  # noqa: E402

if __name__ == "__main__":
    ab_turns.main("pipeline", {"pipelined": lambda model: {"bole_pipeline": True},
                               "serial": lambda model: {"bole_pipeline": False}})  # fmt: skip
