"""The four decoding modes the harness runs side by side (DESIGN.md §7), as `generate` keyword arguments.

ar           plain `model.generate`
chain        hf_bole with topk 1, depth 3 (the SGLang/vLLM MTP default), every row's whole chain verified
tree-serial  the same trees as bole, verified node by node with a state snapshot per node (SGLang-Tree)
bole         hf_bole's closed form with the tree settings given (defaults: hf_bole.BoleConfig)
"""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("ar", "chain", "tree-serial", "bole")
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

    @property
    def drafts(self) -> bool:
        return self.name != "ar"

    def generate_kwargs(self, drafter) -> dict:
        """What `model.generate` gets on top of the common arguments; `drafter` is "mtp", "ngram" or an object."""
        if not self.drafts:
            return {}
        settings = {f"bole_{k}": v for k, v in self.settings().items() if v is not None}  # None: hf_bole's default
        return dict(custom_generate="hf_bole", bole_drafter=drafter, **settings)

    def settings(self) -> dict:
        return {
            "depth": self.depth,
            "topk": self.topk,
            "budget": self.budget,
            "epsilon": self.epsilon,
            "verify": self.verify,
        }


def make_mode(name: str, batch_size: int, args) -> Mode:
    """`name` at `batch_size` with the run's tree settings (`args.depth`, `.topk`, `.budget`, `.epsilon`)."""
    if name == "ar":
        return Mode(name)
    if name == "chain":
        # SGLang/vLLM verify every request's 3 drafted tokens: the budget is the whole batch's chains.
        return Mode(name, depth=CHAIN_DEPTH, topk=1, budget=CHAIN_DEPTH * batch_size, verify="closed_form")
    # With budget "auto" each verify mode reads its own calibration table (hf_bole.generation.budget); both fall
    # back to the same rule where there is none, and an int budget gives both the very same trees.
    tree = dict(depth=args.depth, topk=args.topk, budget=args.budget, epsilon=args.epsilon)
    if name == "tree-serial":
        return Mode(name, **tree, verify="serial")
    if name == "bole":
        return Mode(name, **tree, verify="closed_form")
    raise ValueError(f"unknown mode {name!r}; modes are {', '.join(MODES)}")
