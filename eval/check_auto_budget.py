"""Does `bole_budget="auto"` find a shipped budget table without calibrating? On a GPU, a random-weight model of a
published shape (or the house checkpoint) runs one short `generate` with the default budget; the log line of
`hf_bole.generation.budget` must say it reads a table from the package's tables folder (`hf_bole/budgets/`), not
the fallback. Exit status 0 when it does, 1 otherwise. The user's cache folder is set aside for the run
(`HF_BOLE_CACHE` pointed at an empty folder), so only the shipped tables count.

    python eval/check_auto_budget.py --shape 9B            # bf16 on cuda; the published 9B's table on this GPU
    python eval/check_auto_budget.py --shape house
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hf_bole  # noqa: E402  (registers custom_generate="hf_bole")
from eval.shapes import build_model, shape_config  # noqa: E402
from hf_bole.generation import budget  # noqa: E402


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="9B", help="a published shape (hf_bole.shapes.SHAPES) or 'house'")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)

    os.environ["HF_BOLE_CACHE"] = tempfile.mkdtemp(prefix="hf_bole_empty_cache_")
    lines = _Lines()
    log = logging.getLogger(budget.__name__)
    log.addHandler(lines)
    log.setLevel(logging.INFO)
    model = build_model(shape_config(args.shape), args.device, torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    # the n-gram drafter: a random-weight model has no MTP head; the budget's look-up is the same for every drafter
    model.generate(ids.to(args.device), custom_generate="hf_bole", bole_drafter="ngram", max_new_tokens=8,
                   do_sample=False, pad_token_id=0)  # fmt: skip
    for line in lines.lines:
        print(line)
    shipped = str(budget.PACKAGE_TABLES)
    found = any("reads the verification budget table" in line and shipped in line for line in lines.lines)
    key = budget.TableKey.for_model(model)
    print(f"{args.shape} on {key.device}, {key.dtype}: {'found' if found else 'NOT found'} in {shipped} "
          f"({key.filename})")  # fmt: skip
    return 0 if found else 1


if __name__ == "__main__":
    raise SystemExit(main())
