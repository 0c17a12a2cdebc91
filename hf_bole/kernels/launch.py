"""Launching a compiled Triton kernel again without Triton's per-call host work.

`kernel[grid](*args)` binds and specializes every argument, reads Triton's settings, builds its cache key and, for an
autotuned kernel, looks the config up before it launches: with the verify kernels' ~25 arguments that is tens of
microseconds of host time per call, paid by every GDN layer of an eager forward (under `device_map` CUDA graphs are
off). A `CachedLaunch` launches through Triton the first time it sees a key, keeps the compiled kernel that ran with
its grid and constexpr arguments, and on every later call with the same key hands the arguments straight to that
kernel's launcher (`CompiledKernel.run`, which Triton's own launch calls and which passes them to its C launch
function), with the tensors as their addresses. Triton's per-launch wrapper (`CompiledKernel[grid]`) is skipped unless
a launch hook is registered (a profiler's, e.g. proton's): it builds the hooks' launch metadata, and calls the hooks,
at every launch.

The caller's key must pin everything Triton specializes on, or a later call would run a kernel compiled for other
arguments: every tensor's dtype and whether its address is a multiple of 16 bytes, the value of every integer that is
not in `do_not_specialize` (Triton specializes on == 1 and on multiples of 16), every constexpr, the autotuner's key
and the device. Under the interpreter (`TRITON_INTERPRET=1`) every call goes through Triton.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import NamedTuple

import torch
import triton
from triton.runtime import driver

from hf_bole.kernels.utils import is_interpreter

# Where Triton keeps its launch hooks: `triton.knobs.runtime` (Triton >= 3.4, each a chain of hooks, empty when unset),
# `CompiledKernel`'s class attributes before (None when unset).
_HOOKS = triton.knobs.runtime if hasattr(triton, "knobs") else triton.compiler.CompiledKernel


class CachedLaunch:
    """`launch(key, grid, args, constexprs)` runs `kernel[grid](*args, **constexprs())`: `args` are the kernel's
    leading (non-constexpr) arguments in order, the constexprs and the autotuner's choices follow them;
    `constexprs` (a function, called only when Triton launches) returns the keyword arguments."""

    def __init__(self, kernel):
        self.kernel = kernel  # a JITFunction, or an autotuner / heuristics around one
        self.runners: dict[Hashable, _Compiled] = {}
        self.tuner = kernel
        while not hasattr(self.tuner, "configs") and hasattr(self.tuner, "fn"):
            self.tuner = self.tuner.fn  # the autotuner, if any
        self.configs = getattr(self.tuner, "configs", None)

    def __call__(self, key: Hashable, grid, args: tuple, constexprs: Callable[[], dict]) -> None:
        if self.configs is not None and self.tuner.configs is not self.configs:
            # the autotuner's configs were replaced (a test or `eval/tune_kernels.py` pinning some): choose again
            self.runners.clear()
            self.configs = self.tuner.configs
        hit = self.runners.get(key)
        if hit is not None:
            # Tensors go to the launcher as their addresses: given a tensor, it calls data_ptr() and asks the driver
            # to confirm the address (cuPointerGetAttribute) for every pointer argument at every launch.
            args = list(args)
            for i in hit.pointers:
                args[i] = args[i].data_ptr()
            if _hooked():
                hit.runner(*args, *hit.tail)
            else:
                grid = hit.grid
                stream = driver.active.get_current_stream(driver.active.get_current_device())
                # no launch metadata or hooks (what Triton's runner passes when no hook is registered)
                hit.run(grid[0], grid[1], grid[2], stream, hit.function, hit.metadata, None, None, None, *args,
                        *hit.tail)  # fmt: skip
            return
        if is_interpreter():
            self.kernel[grid](*args, **constexprs())
            return
        grids = []

        def record(meta):
            # The autotuner calls the grid for every config it times; the last call is the launch that stays.
            grids.append(tuple(grid(meta) if callable(grid) else grid) + (1, 1))
            return grids[-1][:3]

        compiled = self.kernel[record](*args, **constexprs())
        grid = grids[-1][:3]
        runner = compiled[grid]  # loads the kernel onto the device: `compiled.function`, `compiled.run` exist after
        self.runners[key] = _Compiled(
            compiled.run, grid, compiled.function, compiled.packed_metadata, self._constexpr_tail(compiled, len(args)),
            tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor)),  # the key pins which are
            runner,
        )

    @staticmethod
    def _constexpr_tail(compiled, n_args: int) -> tuple:
        """The values of the kernel's arguments after the first `n_args`, as compiled (Triton's launcher takes every
        argument in signature order and skips the constexprs)."""
        names = compiled.src.fn.arg_names
        constants = compiled.src.constants  # {(argument index,): value}
        missing = [names[i] for i in range(n_args, len(names)) if (i,) not in constants]
        if missing:
            raise RuntimeError(
                f"{compiled.name}: the arguments {missing} follow the {n_args} passed positionally but were not "
                f"compiled as constexprs; pass them in `args`"
            )
        return tuple(constants[(i,)] for i in range(n_args, len(names)))


class _Compiled(NamedTuple):
    """A compiled kernel as `CachedLaunch` relaunches it."""

    run: Callable  # its launcher: (grid x, y, z, stream, function, metadata, launch metadata, hooks, *arguments)
    grid: tuple[int, int, int]
    function: int  # the loaded kernel's handle
    metadata: tuple  # Triton's packed launch metadata (warps, CTAs, shared memory)
    tail: tuple  # the constexpr arguments' values, as compiled
    pointers: tuple[int, ...]  # which of the leading arguments are tensors
    runner: Callable  # Triton's own launch of it (`CompiledKernel[grid]`), for when a launch hook is registered


def _hooked() -> bool:
    """Whether a launch hook is registered with Triton."""
    for hook in (_HOOKS.launch_enter_hook, _HOOKS.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):  # a function, or a chain holding some
            return True
    return False


def alignment(*addresses: int) -> int | tuple[int, ...]:
    """The key part for tensors' addresses (`Tensor.data_ptr()`): 0 when all are multiples of 16 bytes (the usual
    case), else every address's remainder."""
    bits = 0
    for a in addresses:
        bits |= a
    return 0 if bits % 16 == 0 else tuple(a % 16 for a in addresses)

