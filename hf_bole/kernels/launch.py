"""Launching a compiled Triton kernel again without Triton's per-call host work.

`kernel[grid](*args)` binds and specializes every argument, reads Triton's settings, builds its cache key and, for an
autotuned kernel, looks the config up before it launches: with the verify kernels' ~25 arguments that is tens of
microseconds of host time per call, paid by every GDN layer of an eager forward (under `device_map` CUDA graphs are
off). A `CachedLaunch` launches through Triton the first time it sees a key, keeps the compiled kernel that ran with
its grid and constexpr arguments, and launches that compiled kernel directly (`CompiledKernel[grid]`, Triton's own
launcher) on every later call with the same key.

The caller's key must pin everything Triton specializes on, or a later call would run a kernel compiled for other
arguments: every tensor's dtype and whether its address is a multiple of 16 bytes, the value of every integer that is
not in `do_not_specialize` (Triton specializes on == 1 and on multiples of 16), every constexpr, the autotuner's key
and the device. Under the interpreter (`TRITON_INTERPRET=1`) every call goes through Triton.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch

from hf_bole.kernels.utils import is_interpreter


class CachedLaunch:
    """`launch(key, grid, args, constexprs)` runs `kernel[grid](*args, **constexprs())`: `args` are the kernel's
    leading (non-constexpr) arguments in order, the constexprs and the autotuner's choices follow them;
    `constexprs` (a function, called only when Triton launches) returns the keyword arguments."""

    def __init__(self, kernel):
        self.kernel = kernel  # a JITFunction, or an autotuner / heuristics around one
        self.runners: dict[Hashable, tuple[Callable, tuple, tuple[int, ...]]] = {}
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
            runner, tail, pointers = hit
            # Tensors go to Triton's launcher as their addresses: given a tensor, it calls data_ptr() and asks the
            # driver to confirm the address (cuPointerGetAttribute) for every pointer argument at every launch.
            args = list(args)
            for i in pointers:
                args[i] = args[i].data_ptr()
            runner(*args, *tail)
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
        pointers = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))  # the key pins which are
        self.runners[key] = (compiled[grids[-1][:3]], self._constexpr_tail(compiled, len(args)), pointers)

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


def alignment(*addresses: int) -> int | tuple[int, ...]:
    """The key part for tensors' addresses (`Tensor.data_ptr()`): 0 when all are multiples of 16 bytes (the usual
    case), else every address's remainder."""
    bits = 0
    for a in addresses:
        bits |= a
    return 0 if bits % 16 == 0 else tuple(a % 16 for a in addresses)

