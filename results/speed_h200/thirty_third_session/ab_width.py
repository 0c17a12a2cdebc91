"""Rows capped at their budget's width (`graphs.row_width`: no read of the trees, this session) against the loop
before it (selection uncapped, then `graphs.Trim` of `3a9281e`: the verify forward cut to the widest row's bucket by
a host read while the latest round known could lose a quarter of its width), for bole and tree-serial, in one
process, passes in turns (`eval/ab_turns.py`). Arguments: eval/run.py's; each verify mode runs at its own fixed
budget (`--bole-budget`, `--serial-budget`: the tables' choices at the batch size).

    python results/speed_h200/thirty_third_session/ab_width.py --datasets mbpp --num-prompts 8 --max-new-tokens 128 \\
        --batch-sizes 8 --depth 6 --repeats 10 --bole-budget 192 --serial-budget 64

The "read" variants swap the loop's `row_width` for one that leaves rows uncapped and its selection for one followed
by the old cut; both variants share the verify and selection graphs (keyed by width and cap).
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from eval import ab_turns  # noqa: E402
from hf_bole.generation import loop  # noqa: E402
from hf_bole.generation.graphs import width_bucket  # noqa: E402


class Trim:
    """`graphs.Trim` as of `3a9281e`, several rows replayed from graphs (what the loop ran there at batch 8)."""

    def __init__(self):
        self.widest = None  # the widest row kept (root included) of the latest round the host knows of
        self._arriving = None  # ([1] widest on the host, event after its copy)

    def __call__(self, verify, active_rows):
        if active_rows == 1:
            return verify
        padded = verify.input_ids.shape[1]
        if self._arriving is not None and self._arriving[1].query():
            self.widest, self._arriving = int(self._arriving[0]), None
        if self.widest is not None and 4 * width_bucket(self.widest, padded) > 3 * padded:
            if self._arriving is None:
                widest = verify.num_nodes.amax().reshape(1).to("cpu", non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                self._arriving = (widest, event)
            return verify
        self.widest = int(verify.num_nodes.max())
        return verify.narrowed(width_bucket(self.widest, padded))


ROW_WIDTH, GRAPHED_SELECT = loop.row_width, loop.graphed_select


def read_variant(settings: dict):
    def apply(model) -> dict:
        rows = {}

        def uncapped(budget, active_rows, max_width):
            rows["active"] = active_rows  # for the cut, which the loop calls next
            return max_width

        def graphed_select(model):
            select, trim = GRAPHED_SELECT(model), Trim()  # one cut's state per generate call, as the loop kept it
            return lambda *args: trim(select(*args), rows["active"])

        loop.row_width, loop.graphed_select = uncapped, graphed_select
        return dict(settings)

    return apply


def capped_variant(settings: dict):
    def apply(model) -> dict:
        loop.row_width, loop.graphed_select = ROW_WIDTH, GRAPHED_SELECT
        return dict(settings)

    return apply


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--bole-budget", type=int, required=True)
    ap.add_argument("--serial-budget", type=int, required=True)
    ours, rest = ap.parse_known_args()
    variants = {}
    for mode, settings in (
        ("bole", {"bole_budget": ours.bole_budget}),
        ("tree-serial", {"bole_verify": "serial", "bole_budget": ours.serial_budget}),
    ):
        variants[f"{mode} read"] = read_variant(settings)
        variants[f"{mode} capped"] = capped_variant(settings)
    ab_turns.main("width", variants, rest)
