"""With several rows and CUDA graphs, the verify forward cut to the widest row kept (a host read that waits for
drafting and selection: `graphs.trimmed`, what the loop does) against the full padded width of the round (no read:
the host queues the verify graph while drafting still runs), for bole and tree-serial, in one process, passes in
turns (`eval/ab_turns.py`). Arguments: eval/run.py's.

    python results/speed_h200/twenty_second_session/ab_trim.py --datasets mbpp --num-prompts 8 --max-new-tokens 128 \\
        --batch-sizes 8 --repeats 5

The twenty-first session's kernel log (house, batch 8) showed the GPU idle 0.45 ms before every verify graph's
first kernel. Each variant puts its `trimmed` in the loop's module before its passes; tree-serial is bole's loop
with `bole_verify="serial"`.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from eval import ab_turns  # noqa: E402
from hf_bole.generation import graphs, loop  # noqa: E402


def using(trim, **kwargs):
    def install(model):
        loop.trimmed = trim
        return kwargs

    return install


if __name__ == "__main__":
    padded = lambda verify, graphed: verify if graphed else graphs.trimmed(verify, graphed)  # noqa: E731
    ab_turns.main(
        "trim",
        {
            "bole trimmed": using(graphs.trimmed),
            "bole padded": using(padded),
            "serial trimmed": using(graphs.trimmed, bole_verify="serial"),
            "serial padded": using(padded, bole_verify="serial"),
        },
        sys.argv[1:],
    )
