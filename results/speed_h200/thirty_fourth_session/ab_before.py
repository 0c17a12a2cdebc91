"""The decoding loop of this checkout against an earlier one's, bole and tree-serial, in one process, passes in turns,
without the phase timer (`eval/ab_turns.py`). Arguments: eval/run.py's, then optionally `--before FILE`, the
earlier `hf_bole/generation/loop.py` (made with `git show REV:hf_bole/generation/loop.py > FILE`):

    git show 1b0b240:hf_bole/generation/loop.py > results/raw/loop_1b0b240.py
    python results/speed_h200/thirty_fourth_session/ab_before.py --datasets mbpp --num-prompts 8 \\
        --max-new-tokens 128 --batch-sizes 8 --depth 6 --repeats 10 --before results/raw/loop_1b0b240.py

The earlier module runs on this checkout's other modules (kernels, cache, graphs, drafter); the variants share every
graph and the MTP drafter. Only `loop._decode`, the decoding method `generate` calls, is swapped. A third variant per
mode runs this checkout's loop with the token writes launched from Python (`loop.ShapeGraphs` made a pass-through).
Without `--before`, only this checkout's two variants per mode run.
"""

import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from eval import ab_turns  # noqa: E402
from hf_bole.generation import loop  # noqa: E402

NOW = loop._decode


def load_before(path: str):
    spec = importlib.util.spec_from_file_location("loop_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["loop_before"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    module._MTP_DRAFTERS = loop._MTP_DRAFTERS  # one drafter (its graphs and compile) for both
    return module


SHAPE_GRAPHS = loop.ShapeGraphs


def variant(decode, settings: dict, write_graphs: bool = True):
    def apply(model) -> dict:
        loop._decode = decode
        loop.ShapeGraphs = SHAPE_GRAPHS if write_graphs else (lambda run: run)
        return dict(settings)

    return apply


if __name__ == "__main__":
    argv = sys.argv[1:]
    before = None
    if "--before" in argv:
        at = argv.index("--before")
        before = load_before(argv[at + 1])
        del argv[at : at + 2]
    variants = {}
    for mode, settings in (("bole", {}), ("tree-serial", {"bole_verify": "serial"})):
        if before is not None:
            variants[f"{mode} before"] = variant(before._decode, settings)
        variants[f"{mode} now"] = variant(NOW, settings)
        variants[f"{mode} now, writes eager"] = variant(NOW, settings, write_graphs=False)
    ab_turns.main("before", variants, argv, profile=False)
