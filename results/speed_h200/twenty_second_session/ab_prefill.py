"""The prompt prefilled by "auto" against chains at any length (`bole_prefill="chains"`), in one process, passes in
turns (`eval/ab_turns.py`). Arguments: eval/run.py's.

    python results/speed_h200/twenty_second_session/ab_prefill.py --datasets mbpp --num-prompts 8 \\
        --max-new-tokens 128 --batch-sizes 8 --repeats 5

"auto" prefills as chains through the verify graphs only up to `CHAIN_PREFILL_MAX` (512 tokens), set on the 9B
shape, whose every chain reads its 18 GB of weights again. MBPP's few-shot prompts run about 900 tokens, so the house
model prefills them through transformers' eager forward. In the twenty-second session's house tables that took
60–76 ms of TTFT, about a quarter of a batch-8 call. tree-serial cannot prefill as chains (a snapshot per prompt
token), so chains would widen bole's lead over it.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from eval import ab_turns  # noqa: E402

if __name__ == "__main__":
    ab_turns.main("prefill", {"auto": lambda model: {}, "chains": lambda model: {"bole_prefill": "chains"}}, sys.argv[1:])
