"""With several rows and CUDA graphs: the verify forward cut to the widest row kept every round (a host read that
waits for drafting and selection, what the loop did up to the twenty-second session's call 1) against the loop's
`graphs.Trim` (the read only while the latest round known could be cut by a quarter or more), for bole and
tree-serial, in one process, passes in turns (`eval/ab_turns.py`). Arguments: eval/run.py's.

    python results/speed_h200/twenty_second_session/ab_trim.py --datasets mbpp --num-prompts 8 --max-new-tokens 128 \\
        --batch-sizes 8 --repeats 5

Each variant puts its class in the loop's module before its passes; tree-serial is bole's loop with
`bole_verify="serial"`.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from eval import ab_turns  # noqa: E402
from hf_bole.generation import graphs, loop  # noqa: E402


class EveryRound(graphs.Trim):
    """The loop before `Trim`: several rows (or one, neither pipelined nor graphed) always cut, by a host read."""

    def __call__(self, verify, active_rows):
        if active_rows > 1 or not (self.pipelined or self.graphed):
            return graphs.trimmed(verify, self.graphed)
        return verify


def using(trim, **kwargs):
    def install(model):
        loop.Trim = trim
        return kwargs

    return install


if __name__ == "__main__":
    ab_turns.main(
        "trim",
        {
            "bole every round": using(EveryRound),
            "bole Trim": using(graphs.Trim),
            "serial every round": using(EveryRound, bole_verify="serial"),
            "serial Trim": using(graphs.Trim, bole_verify="serial"),
        },
        sys.argv[1:],
    )
