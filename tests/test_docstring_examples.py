"""The docstrings' self-contained examples run as written: a documented call that stopped working fails here.

Examples sit in Markdown fences, as in transformers' docstrings; plain doctest would read the closing fence as
expected output, so an example's expected output here stops at a fence. The modules listed are those whose examples
need nothing but their own lines (the others load a model or a checkpoint).
"""

from __future__ import annotations

import doctest
import importlib
import re

import pytest


class _FencedParser(doctest.DocTestParser):
    # doctest's own example pattern, with one more rule for the expected output: no line that opens or closes a
    # Markdown fence
    _EXAMPLE_RE = re.compile(
        r"""
        (?P<source>(?:^(?P<indent>[ ]*)>>>.*)(?:\n[ ]*\.\.\..*)*)\n?
        (?P<want>(?:(?![ ]*$)(?![ ]*>>>)(?![ ]*```).+$\n?)*)
        """,
        re.MULTILINE | re.VERBOSE,
    )


SELF_CONTAINED = (
    "hf_bole.config",
    "hf_bole.generation.acceptance",
    "hf_bole.generation.budget.calibration.capacities",
    "hf_bole.generation.budget.rule.choose_budget",
    "hf_bole.generation.drafters.ngram",
    "hf_bole.generation.phases",
    "hf_bole.generation.select",
    "hf_bole.generation.tree",
    "hf_bole.kernels.tree_gdn.closed_form",
    "hf_bole.kernels.tree_gdn.commit",
    "hf_bole.kernels.tree_gdn.tree_conv",
    "hf_bole.shapes",
)


def _examples(name: str) -> list[doctest.DocTest]:
    """The doctests of module `name`, or of one function of a module (`module.function`)."""
    try:
        module, only = importlib.import_module(name), None
    except ModuleNotFoundError:
        module_name, only = name.rsplit(".", 1)
        module = importlib.import_module(module_name)
    tests = doctest.DocTestFinder(parser=_FencedParser()).find(module)
    return [t for t in tests if t.examples and (only is None or t.name.endswith(f".{only}"))]


@pytest.mark.parametrize("name", SELF_CONTAINED)
def test_docstring_examples_run(name):
    tests = _examples(name)
    assert tests, f"{name} has no examples"
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    report = []
    for test in tests:
        runner.run(test, out=report.append)
    assert runner.failures == 0, "".join(report)
