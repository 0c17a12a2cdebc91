"""How wide each round's widest row is after selection: eval/run.py with the loop's verify cut wrapped to record,
per (batch, padded width), the widest row kept (root included) of every round. A CPU run is enough (selection
depends on the drafter, not on the hardware). Arguments: eval/run.py's.

    python results/speed_h200/twenty_second_session/widths.py --shape house --drafter oracle --modes bole \\
        --budget 32 --depth 6 --batch-sizes 8 16 --num-prompts 16 --max-new-tokens 64 --output-dir /tmp/widths
"""

import collections
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from eval import run  # noqa: E402
from hf_bole.generation import graphs  # noqa: E402

seen = collections.defaultdict(list)  # (batch, padded width) -> widest row of each round
cut = graphs.trimmed


def recorded(verify, graphed):
    seen[tuple(verify.input_ids.shape)].append(int(verify.num_nodes.max()))
    return cut(verify, graphed)


if __name__ == "__main__":
    graphs.trimmed = recorded  # what the loop's Trim calls on the CPU (no graphs: every round of several rows)
    run.main(sys.argv[1:])
    for (B, W), widest in sorted(seen.items()):
        widest.sort()
        print(f"batch {B}, padded width {W}: {len(widest)} rounds, widest row median {statistics.median(widest)}, "
              f"p10 {widest[len(widest) // 10]}, p90 {widest[9 * len(widest) // 10]}, "
              f"at most {W // 2 + 1}: {sum(w <= W // 2 + 1 for w in widest) / len(widest):.0%}")  # fmt: skip
