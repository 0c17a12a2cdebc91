"""Selection in one Triton launch against select_nodes' small kernels, in one process, passes taken in turns
(`eval/ab_turns.py`): only the selection is swapped, `graphs.select_round` being the kernel (as the loop runs it) or
`select_nodes` (main before this session), each with its own CUDA-graph store, captured while it is in force.
Everything else is the same code. Takes eval/run.py's arguments.

    python results/speed_h200/thirteenth_session/ab_select.py --shape 9B --depth 6 --max-new-tokens 128 --batch-sizes 1 \
        --num-prompts 2 --repeats 7 --profile
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from eval import ab_turns  # noqa: E402
from hf_bole.generation import graphs  # noqa: E402
from hf_bole.generation.select import select_nodes  # noqa: E402
from hf_bole.generation.select_kernel import select_round  # noqa: E402


def selecting_with(select, store: graphs.SelectGraphs):
    """The variant whose rounds select with `select`, from graphs kept in `store`."""

    def in_force(model) -> dict:
        graphs.select_round = select
        graphs._SELECT[model] = store
        return {}

    return in_force


if __name__ == "__main__":
    ab_turns.main("select", {"kernel": selecting_with(select_round, graphs.SelectGraphs()),
                             "torch": selecting_with(select_nodes, graphs.SelectGraphs())})  # fmt: skip
