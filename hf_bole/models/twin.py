"""The modules a tree forward runs: a twin of the decoder with its projection groups as one GEMM each
(`models/fused.py`) and its RMSNorms as one kernel each (`models/norms.py`), the model's own modules untouched.

Swapping the stand-ins into the model for the length of a tree forward would change what a plain forward of the same
model computes meanwhile, in another thread (serving code shares models between threads): other GEMMs and norm
kernels round differently, and a fused part called with another thread's input cannot tell it from a transformers
version that calls a group's projections on different inputs. So the tree forward calls a twin instead: a shallow
copy (`copy.copy`: the same parameters, buffers, hooks and attributes) of every module on the paths from the decoder
to the modules stood in for, each copy with its own children, the stand-ins among them; every other module is the
model's own. Made once per decoder and kind, and made again when the model changed since: a module on those paths
or stood in for was given other attributes or children (`model.train()`, a module replaced, hooks that accelerate
adds), or a group's weights moved (`model.to(...)`).
"""

from __future__ import annotations

import contextlib
import copy
import operator
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn

from hf_bole.models.fused import _Group, projection_stand_ins
from hf_bole.models.norms import norm_stand_ins


@dataclass(eq=False)
class _Seen:
    """A module's attributes when the twin was made (kept alive, so that their ids are not reused): of a copied module
    all of them and its children, of a module stood in for how many (what accelerate's hooks add); its weights are
    checked apart (`_Group.intact`), and a norm's stand-in reads its weight at every call."""

    module: nn.Module
    size: int
    values: tuple | None  # a copied module's attributes
    children: tuple | None  # a copied module's children

    @classmethod
    def of(cls, module: nn.Module, copied: bool) -> _Seen:
        d = module.__dict__
        if not copied:
            return cls(module, len(d), None, None)
        return cls(module, len(d), tuple(d.values()), tuple(module._modules.values()))

    def unchanged(self) -> bool:
        d = self.module.__dict__
        if len(d) != self.size:
            return False
        if self.values is None:
            return True
        children = self.module._modules
        return (
            all(map(operator.is_, d.values(), self.values))
            and len(children) == len(self.children)
            and all(map(operator.is_, children.values(), self.children))
        )


@dataclass(eq=False)
class Twin:
    """A tree twin (`tree_twin`): `module` is called in place of the decoder it was made from."""

    module: nn.Module
    seen: list[_Seen]
    groups: list[_Group]

    def fresh(self) -> bool:
        """Whether the decoder is as it was when this twin was made (an identity check per attribute)."""
        return all(s.unchanged() for s in self.seen) and all(group.intact() for group in self.groups)

    @contextlib.contextmanager
    def entered(self) -> Iterator[nn.Module]:
        """Yields `module` for one forward, and forgets this thread's partial products of fused groups after it (what
        a forward that raised between a group's projections leaves behind)."""
        try:
            yield self.module
        finally:
            for group in self.groups:
                group.reset()


# decoder -> {(projections, norms): Twin} (the twins hold the decoder's modules, never the decoder itself)
_TWINS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def tree_twin(decoder: nn.Module, projections: bool, norms: bool) -> Twin:
    """The twin of `decoder` a tree forward runs: with its projection groups fused (`projections`) and its Qwen3.5
    RMSNorms as one kernel each (`norms`); `decoder` itself when neither. Made once, and again when `decoder` changed
    since (`Twin.fresh`)."""
    with _LOCK:  # one thread makes it (and fuses the weights), the others wait for it
        held = _TWINS.setdefault(decoder, {})
        twin = held.get((projections, norms))
        if twin is not None and twin.fresh():
            return twin
        stand_ins, groups = projection_stand_ins(decoder) if projections else ({}, [])
        if norms:
            stand_ins.update(norm_stand_ins(decoder))
        twin = held[projections, norms] = _make(decoder, stand_ins, groups)
        return twin


def _make(root: nn.Module, stand_ins: dict[tuple[nn.Module, str], nn.Module], groups: list[_Group]) -> Twin:
    parents = {id(parent) for parent, _ in stand_ins}
    paths: set[int] = set()  # ids of the modules with a stood-in module at or below them

    def mark(module: nn.Module) -> bool:
        below = [mark(child) for child in module._modules.values() if child is not None]
        if id(module) in parents or any(below):
            paths.add(id(module))
            return True
        return False

    mark(root)
    seen = [_Seen.of(parent._modules[name], copied=False) for parent, name in stand_ins]
    copies: dict[int, nn.Module] = {}

    def twin_of(module: nn.Module | None) -> nn.Module | None:
        if module is None or id(module) not in paths:
            return module
        if id(module) not in copies:
            twin = copy.copy(module)  # its own __dict__; _parameters, _buffers and the hooks' dicts shared
            twin.__dict__["_modules"] = {
                name: stand_ins[module, name] if (module, name) in stand_ins else twin_of(child)
                for name, child in module._modules.items()
            }
            copies[id(module)] = twin
            seen.append(_Seen.of(module, copied=True))
        return copies[id(module)]

    return Twin(twin_of(root), seen, groups)
