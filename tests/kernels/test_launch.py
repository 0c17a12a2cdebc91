"""CachedLaunch: Triton's launch the first time per key, the compiled kernel directly afterwards. On a GPU the tree
kernels' tests exercise it through `tree_gdn_verify`; here a stand-in kernel records what each path is given (without a
GPU, Triton compiles nothing)."""

from __future__ import annotations

import types

import pytest
import torch

from hf_bole.kernels.launch import CachedLaunch, alignment


class Compiled:
    """What Triton's launch returns: `src.fn.arg_names`, `src.constants` ({(index,): value}) and `[grid](*args)`."""

    def __init__(self, calls):
        self.name = "kernel"
        self.src = types.SimpleNamespace(
            fn=types.SimpleNamespace(arg_names=["x", "n", "BLOCK", "BK"]), constants={(2,): 64, (3,): 32}
        )
        self.calls = calls

    def __getitem__(self, grid):
        return lambda *args: self.calls.append(("direct", grid, args))


class Tuner:
    """An autotuner's interface as CachedLaunch sees it: `configs`, and `[grid](*args, **kwargs)` that calls a grid
    function with the chosen config's meta-parameters."""

    def __init__(self):
        self.configs = ["BK=32"]
        self.calls = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append(("triton", grid({"BK": 32}) if callable(grid) else grid, args, kwargs))
            return Compiled(self.calls)

        return launch


@pytest.fixture
def compiled_mode(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def test_cached_launch_relaunches_the_compiled_kernel(compiled_mode):
    tuner = Tuner()
    launch = CachedLaunch(tuner)

    def grid(meta):
        return (128 // meta["BK"],)

    launch("a", grid, ("x0", 7), lambda: {"BLOCK": 64})
    assert tuner.calls[-1] == ("triton", (4, 1, 1), ("x0", 7), {"BLOCK": 64})
    launch("a", grid, ("x1", 8), lambda: pytest.fail("constexprs are built only for Triton's launch"))
    assert tuner.calls[-1] == ("direct", (4, 1, 1), ("x1", 8, 64, 32))  # the tail from the compiled constants
    launch("b", (3, 2), ("x2", 9), lambda: {"BLOCK": 64})
    assert tuner.calls[-1][:2] == ("triton", (3, 2, 1))
    tuner.configs = ["BK=64"]  # pinned by a test or the tuning script: every key goes through the autotuner again
    launch("a", grid, ("x3", 7), lambda: {"BLOCK": 64})
    assert tuner.calls[-1][0] == "triton"
    assert len(tuner.calls) == 4


def test_cached_launch_passes_tensors_as_their_addresses(compiled_mode):
    """Triton's launch gets the tensors (it specializes on their dtypes); the compiled kernel their addresses, which
    its launcher would otherwise ask of the tensor and then of the driver, argument by argument."""
    tuner = Tuner()
    launch = CachedLaunch(tuner)
    x0, x1 = torch.zeros(4), torch.ones(8)
    launch("a", (1,), (x0, 7), lambda: {"BLOCK": 64})
    assert tuner.calls[-1][2][0] is x0
    launch("a", (1,), (x1, 8), dict)
    assert tuner.calls[-1] == ("direct", (1, 1, 1), (x1.data_ptr(), 8, 64, 32))


def test_cached_launch_under_the_interpreter_always_goes_through_triton(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    tuner = Tuner()
    launch = CachedLaunch(tuner)
    for _ in range(2):
        launch("a", (1,), ("x", 1), dict)
    assert [c[0] for c in tuner.calls] == ["triton", "triton"] and not launch.runners


def test_cached_launch_names_arguments_not_compiled_as_constexprs(compiled_mode):
    tuner = Tuner()
    launch = CachedLaunch(tuner)
    with pytest.raises(RuntimeError, match=r"\['n'\]"):
        launch("a", (1,), ("x",), dict)  # n is a runtime argument, not among the compiled constants


def test_alignment():
    assert alignment(0, 16, 4096) == 0
    assert alignment(0, 18, 4) == (0, 2, 4)
