"""The verify forward's rotary embeddings as one kernel per attention layer (`hf_bole.models.rotary`) against
transformers' elementwise form, for bole and tree-serial, in one process, passes in turns (`eval/ab_turns.py`).
Arguments: eval/run.py's.

    python results/speed_h200/thirty_second_session/ab_rotary.py --datasets mbpp --num-prompts 8 \\
        --max-new-tokens 128 --batch-sizes 8 --depth 6 --repeats 10

CUDA graphs hold the kernels they captured: each variant keeps its own verify graphs (`graphs._STORE` swapped per
variant), so "elementwise" replays forwards captured without the stand-in. Every output must still equal plain
greedy's (the kernel rounds as transformers does).
"""

import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from eval import ab_turns  # noqa: E402
from hf_bole.generation import graphs  # noqa: E402
from hf_bole.models import qwen3_5, rotary  # noqa: E402

STORES: dict[str, dict] = {}


def variant(name: str, fused: bool, settings: dict):
    def apply(model) -> dict:
        graphs._STORE[model] = STORES.setdefault(name, {})  # this variant's captured verify graphs
        qwen3_5.rotary_fused = rotary.rotary_fused if fused else contextlib.nullcontext
        return dict(settings)

    return apply


if __name__ == "__main__":
    variants = {}
    for mode, settings in (("bole", {}), ("tree-serial", {"bole_verify": "serial"})):
        variants[f"{mode} elementwise"] = variant(f"{mode} elementwise", False, settings)
        variants[f"{mode} rotary kernel"] = variant(f"{mode} rotary kernel", True, settings)
    ab_turns.main("rotary", variants, sys.argv[1:])
