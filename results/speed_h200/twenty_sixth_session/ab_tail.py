"""A greedy round's tail (acceptance, commit, the drafter's next inputs) replayed from a CUDA graph
(`graphs.TailGraphs`) against the same work launched from Python (`tail.greedy_tail`, the loop before it), for bole
and tree-serial, in one process, passes in turns (`eval/ab_turns.py`). Arguments: eval/run.py's.

    python results/speed_h200/twenty_sixth_session/ab_tail.py --datasets mbpp --num-prompts 8 --max-new-tokens 128 \\
        --batch-sizes 8 --repeats 5

tree-serial is bole's loop with `bole_verify="serial"`.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from eval import ab_turns  # noqa: E402
from hf_bole.generation import graphs  # noqa: E402
from hf_bole.generation.tail import greedy_tail  # noqa: E402

REPLAYED = graphs.TailGraphs.__call__


def launched(self, verify, out, active, step, width):
    return greedy_tail(self.cache, verify, out.logits, out.hidden_states, active, step, width)


def using(call, **kwargs):
    def install(model):
        graphs.TailGraphs.__call__ = call
        return kwargs

    return install


if __name__ == "__main__":
    ab_turns.main(
        "tail",
        {
            "bole graph": using(REPLAYED),
            "bole python": using(launched),
            "serial graph": using(REPLAYED, bole_verify="serial"),
            "serial python": using(launched, bole_verify="serial"),
        },
    )
