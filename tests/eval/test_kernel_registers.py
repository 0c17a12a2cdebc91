"""eval/kernel_registers.py compiles every part's kernels for sm_90a with the constexprs and argument types a model
launches them with (no GPU needed): a kernel whose signature moved on fails here, not on the device."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_part_compiles():
    cmd = [sys.executable, "eval/kernel_registers.py", "--kernels", "gdn", "attention", "masks", "kv", "--tile", "32"]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = re.findall(r"^(\w+) .* (\d+) +(\d+) +(\d+)$", run.stdout, flags=re.M)
    kernels = {name for name, *_ in rows}
    assert kernels == {"solve", "apply", "split", "merge", "masks", "kv"}, run.stdout
    assert all(0 < int(registers) <= 255 for _, registers, _, _ in rows)
