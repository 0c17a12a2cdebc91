"""The four decoding modes the harness runs side by side (DESIGN.md §7), as `generate` keyword arguments.

ar           plain `model.generate`
ar-static    plain `model.generate` with a static cache, which transformers compiles with torch.compile where it
             can (on CUDA): the other configuration of the `ar` baseline (issue 8)
chain        hf_bole with topk 1, depth 3 (the SGLang/vLLM MTP default; `--chain-depth`), every row's whole chain
             verified
tree-serial  the same trees as bole, verified node by node with a state snapshot per node (SGLang-Tree)
bole         hf_bole's closed form with the tree settings given (defaults: hf_bole.BoleConfig)

Sweeps: several `--depth`, `--budget` or `--epsilon` values, or `--compile off on`, run `tree-serial` and `bole`
once per combination; each then carries a label such as `bole d5 b64` or `bole compiled` (only the swept settings
are named). Several `--chain-depth` values run `chain` once each (`chain d6`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

MODES = ("ar", "ar-static", "chain", "tree-serial", "bole")
CHAIN_DEPTH = 3


@dataclass
class Mode:
    """One decoding mode at one batch size. `depth`/`topk` are None for `ar` (no drafting)."""

    name: str
    depth: int | None = None
    topk: int | None = None
    budget: int | str | None = None
    epsilon: float | None = None
    verify: str | None = None
    attention: str | None = None  # how full-attention layers attend in the verify forward (bole_attention)
    compile: bool = False  # the verify forward and the MTP drafter's rounds through torch.compile (bole_compile)
    label: str = ""  # the name plus the swept settings; the name alone when nothing is swept

    def __post_init__(self):
        self.label = self.label or self.name

    @property
    def drafts(self) -> bool:
        return self.name not in ("ar", "ar-static")

    def generate_kwargs(self, drafter) -> dict:
        """What `model.generate` gets on top of the common arguments; `drafter` is "mtp", "ngram" or an object."""
        if self.name == "ar-static":
            return dict(cache_implementation="static")
        if not self.drafts:
            return {}
        settings = {f"bole_{k}": v for k, v in self.settings().items() if v is not None}  # None: hf_bole's default
        # The harness asks for dict outputs (its statistics), which would have hf_bole hand its cache back, cutting
        # every round's commits at EOS and the length limit: timed as a call that returns tokens alone would run.
        return dict(custom_generate="hf_bole", bole_drafter=drafter, bole_compile=self.compile, use_cache=False,
                    **settings)  # fmt: skip

    def settings(self) -> dict:
        return {
            "depth": self.depth,
            "topk": self.topk,
            "budget": self.budget,
            "epsilon": self.epsilon,
            "verify": self.verify,
            "attention": self.attention,
        }


def make_modes(name: str, batch_size: int, args) -> list[Mode]:
    """`name` at `batch_size`: one mode, or for `tree-serial` and `bole` one per combination of the run's tree
    settings (`args.depth`, `.budget`, `.epsilon` and `.compile` are lists; `.topk` one value)."""
    if name in ("ar", "ar-static"):
        return [Mode(name)]
    attention = getattr(args, "attention", None)  # None: hf_bole's default
    if name == "chain":
        # SGLang/vLLM verify every request's drafted tokens (3 by default): the budget is the whole batch's chains.
        depths = args.chain_depth
        return [
            Mode(name, depth=depth, topk=1, budget=depth * batch_size, verify="closed_form", attention=attention,
                 compile=compiled, label=" ".join([name] + [f"d{depth}"] * (len(depths) > 1)
                                                  + ["compiled"] * (compiled and len(args.compile) > 1)))
            for compiled, depth in itertools.product(args.compile, depths)
        ]  # fmt: skip
    if name not in MODES:
        raise ValueError(f"unknown mode {name!r}; modes are {', '.join(MODES)}")
    # With budget "auto" each verify mode reads its own calibration table (hf_bole.generation.budget); both fall
    # back to the same rule where there is none, and an int budget gives both the very same trees.
    verify = "serial" if name == "tree-serial" else "closed_form"
    swept = {k: len(getattr(args, k)) > 1 for k in ("depth", "budget", "epsilon")}
    modes = []
    for compiled, depth, budget, epsilon in itertools.product(args.compile, args.depth, args.budget, args.epsilon):
        if isinstance(budget, int) and epsilon != args.epsilon[0]:
            continue  # epsilon only shapes the "auto" budget: a fixed budget runs once
        tags = [f"{k[0]}{v}" for k, v in (("depth", depth), ("budget", budget), ("epsilon", epsilon)) if swept[k]]
        if isinstance(budget, int) and swept["epsilon"]:
            tags.pop()  # no epsilon in a fixed budget's label
        tags += ["compiled"] * (compiled and len(args.compile) > 1)
        label = " ".join([name, *tags])
        modes.append(Mode(name, depth, args.topk, budget, epsilon, verify, attention, compiled, label))
    return modes
