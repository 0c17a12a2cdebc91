"""CachedLaunch: Triton's launch the first time per key, the compiled kernel directly afterwards. On a GPU the tree
kernels' tests exercise it through `tree_gdn_verify`; here a stand-in kernel records what each path is given (without a
GPU, Triton compiles nothing)."""

from __future__ import annotations

import types

import pytest
import torch

from hf_bole.kernels import launch as launch_module
from hf_bole.kernels.launch import CachedLaunch, alignment


class Compiled:
    """What Triton's launch returns: `src.fn.arg_names`, `src.constants` ({(index,): value}), the loaded kernel
    (`function`, `packed_metadata`), its launcher `run` and Triton's wrapper around that, `[grid](*args)`."""

    def __init__(self, calls):
        self.name = "kernel"
        self.src = types.SimpleNamespace(
            fn=types.SimpleNamespace(arg_names=["x", "n", "BLOCK", "BK"]), constants={(2,): 64, (3,): 32}
        )
        self.function, self.packed_metadata = 1234, (4, 1, 0)
        self.calls = calls

    def run(self, gx, gy, gz, stream, function, metadata, launch_metadata, enter_hook, exit_hook, *args):
        launch = (stream, function, metadata, launch_metadata, enter_hook, exit_hook)
        assert launch == (77, 1234, (4, 1, 0), None, None, None)
        self.calls.append(("direct", (gx, gy, gz), args))

    def __getitem__(self, grid):
        return lambda *args: self.calls.append(("runner", grid, args))


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
    # the current stream, as Triton's driver reads it on a GPU
    monkeypatch.setattr(launch_module.driver, "_active", types.SimpleNamespace(
        get_current_device=lambda: 0, get_current_stream=lambda device: 77))  # fmt: skip


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


def test_cached_launch_goes_through_tritons_wrapper_while_a_launch_hook_is_registered(compiled_mode, monkeypatch):
    """A profiler's hook (e.g. proton's) sees every launch: with one registered, the compiled kernel is relaunched
    through Triton's wrapper, which builds the hook's launch metadata and calls it."""
    tuner = Tuner()
    launch = CachedLaunch(tuner)
    x = torch.zeros(4)
    launch("a", (2,), (x, 7), dict)
    hooks = launch_module._HOOKS
    if hasattr(hooks.launch_enter_hook, "add"):  # Triton >= 3.4: a chain of hooks
        hook = print
        hooks.launch_enter_hook.add(hook)
        cleanup = lambda: hooks.launch_enter_hook.remove(hook)  # noqa: E731
    else:
        monkeypatch.setattr(hooks, "launch_enter_hook", print)
        cleanup = lambda: None  # noqa: E731
    try:
        launch("a", (2,), (x, 8), dict)
    finally:
        cleanup()
    assert tuner.calls[-1] == ("runner", (2, 1, 1), (x.data_ptr(), 8, 64, 32))
    launch("a", (2,), (x, 9), dict)
    assert tuner.calls[-1] == ("direct", (2, 1, 1), (x.data_ptr(), 9, 64, 32))


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
