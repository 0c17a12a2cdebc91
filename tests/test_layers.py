"""How hf_bole's parts depend on each other: layers point one way, and no subpackage imports, through any chain of
modules, one that imports it back.

    kernels/      imports nothing else of hf_bole (kernels take tensors)
    cache/        kernels/, config, placement, tensor_parallel: nothing of models/ or generation/
    models/       the model adapters: cache/, kernels/, config, placement
    generation/   the decoding round and everything before and after it
    hf_bole/__init__.py imports them all; nothing in hf_bole imports eval/ (the harness sits on top).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import hf_bole

PACKAGE = Path(hf_bole.__file__).parent
SUBPACKAGES = ("kernels", "cache", "models", "generation")
# What each layer may import besides itself.
ALLOWED = {
    "kernels": set(),
    "cache": {"kernels", "config", "placement", "tensor_parallel"},
    "models": {"cache", "kernels", "config", "placement"},
}


def _unit(module: str) -> str:
    """A module's part: its subpackage (`hf_bole.generation.budget.rule` -> generation) or top-level module."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "hf_bole"


def _imports() -> dict[str, set[str]]:
    """module -> the hf_bole modules and packages it imports anywhere in its source (also inside functions), and
    every package on the way to them (importing `hf_bole.a.b` runs `hf_bole.a` first)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
                names.update(f"{node.module}.{a.name}" for a in node.names)
        targets = set()
        for name in names:
            if name == "eval" or name.startswith("eval."):
                targets.add(name)
            if name.startswith("hf_bole."):
                parts = name.split(".")
                targets.update(".".join(parts[:i]) for i in range(2, len(parts) + 1))
        out[module] = targets
    return out


def test_layers_point_one_way():
    wrong = []
    for module, targets in _imports().items():
        for target in targets:
            if target == "eval" or target.startswith("eval."):
                wrong.append(f"{module} imports {target}")
                continue
            unit, other = _unit(module), _unit(target)
            if unit in ALLOWED and other != unit and other not in ALLOWED[unit]:
                wrong.append(f"{module} imports {target}")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_cycle_between_parts():
    """Subpackages and top-level modules (hf_bole/__init__.py aside, which imports them all) form no cycle."""
    graph: dict[str, set[str]] = {}
    for module, targets in _imports().items():
        if module == "hf_bole":
            continue
        unit = _unit(module)
        graph.setdefault(unit, set()).update(_unit(t) for t in targets if _unit(t) not in (unit, "hf_bole"))
    done, path = set(), []

    def visit(unit: str) -> None:
        if unit in path:
            raise AssertionError(f"import cycle: {' -> '.join(path[path.index(unit) :] + [unit])}")
        if unit in done:
            return
        path.append(unit)
        for other in sorted(graph.get(unit, ())):
            visit(other)
        path.pop()
        done.add(unit)

    for unit in sorted(graph):
        visit(unit)


@pytest.mark.parametrize(
    "order",
    [
        ["hf_bole.kernels", "hf_bole.cache", "hf_bole.models", "hf_bole.generation"],
        ["hf_bole.generation.loop", "hf_bole.models", "hf_bole.cache", "hf_bole.kernels"],
        ["hf_bole.generation.budget", "hf_bole.calibrate"],
        ["hf_bole.calibrate", "hf_bole.generation.verify", "hf_bole.generation.commit"],
    ],
)
def test_subpackages_import_in_a_fresh_interpreter(order):
    """Each order in a new interpreter: a cycle that the usual order hides fails here with a partly initialised
    module."""
    code = "\n".join(f"import {name}" for name in order)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE.parent)
    assert result.returncode == 0, result.stderr
