"""Tree-decoding settings: the one home of their defaults."""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any

VERIFY_MODES = ("closed_form", "serial")
BUILTIN_DRAFTERS = ("mtp", "ngram")
KWARG_PREFIX = "bole_"


@dataclass
class BoleConfig:
    r"""
    Settings of hf_bole's tree speculative decoding. They reach `generate` as `bole_<field>` keyword arguments or
    as `bole_<field>` attributes of a `GenerationConfig` (see `from_generate_kwargs`); every default lives here.

    Args:
        depth (`int`, *optional*, defaults to 5):
            The deepest a draft tree grows below the root (drafting steps per round).
        topk (`int`, *optional*, defaults to 4):
            Children a drafter considers per expanded node (MTP: tokens per expansion; n-gram: continuations per
            branch point).
        budget (`int`, *optional*, defaults to 32):
            Draft nodes verified per round across the whole batch, the roots not counted (DESIGN.md §5). Every
            request with a draft still keeps its best root child when the budget is smaller than the batch.
        verify (`str`, *optional*, defaults to `"closed_form"`):
            How GDN layers verify the tree: `"closed_form"` (one solve over all nodes, state factors) or
            `"serial"` (node by node with a state snapshot per node, the SGLang-Tree baseline).
        drafter (`str` or object, *optional*, defaults to `"mtp"`):
            `"mtp"` (the checkpoint's multi-token-prediction head), `"ngram"` (prompt lookup, no weights), or any
            object with a `propose(ctx) -> DraftTree` method.
        ngram_max_size (`int`, *optional*, defaults to 3):
            The longest suffix the n-gram drafter looks up in the committed tokens.
        ngram_min_size (`int`, *optional*, defaults to 1):
            The shortest suffix it falls back to when longer ones never occurred before.

    Example:

    ```python
    >>> from hf_bole.config import BoleConfig
    >>> config, rest = BoleConfig.from_generate_kwargs({"bole_depth": 3, "max_new_tokens": 8})
    >>> config.depth, rest
    (3, {'max_new_tokens': 8})
    ```
    """

    depth: int = 5
    topk: int = 4
    budget: int = 32
    verify: str = "closed_form"
    drafter: Any = "mtp"
    ngram_max_size: int = 3
    ngram_min_size: int = 1

    def __post_init__(self):
        for name in ("depth", "topk", "budget", "ngram_max_size", "ngram_min_size"):
            value = getattr(self, name)
            # bool is an int subclass: `bole_depth=True` is a mistake, not 1.
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"BoleConfig.{name} must be a positive int, got {value!r}")
        if self.verify not in VERIFY_MODES:
            raise ValueError(f"BoleConfig.verify must be one of {VERIFY_MODES}, got {self.verify!r}")
        if isinstance(self.drafter, str):
            if self.drafter not in BUILTIN_DRAFTERS:
                raise ValueError(
                    f"BoleConfig.drafter must be one of {BUILTIN_DRAFTERS} or an object with a "
                    f"`propose(ctx) -> DraftTree` method, got {self.drafter!r}"
                )
        elif not callable(getattr(self.drafter, "propose", None)):
            raise ValueError(
                f"BoleConfig.drafter must be one of {BUILTIN_DRAFTERS} or an object with a "
                f"`propose(ctx) -> DraftTree` method, got {type(self.drafter).__name__} without one"
            )
        if self.ngram_min_size > self.ngram_max_size:
            raise ValueError(
                f"BoleConfig.ngram_min_size ({self.ngram_min_size}) must not exceed "
                f"ngram_max_size ({self.ngram_max_size})"
            )

    @classmethod
    def kwarg_names(cls) -> tuple[str, ...]:
        """The `generate` keyword arguments this config reads: `bole_config` and `bole_<field>` for every field."""
        return (f"{KWARG_PREFIX}config",) + tuple(KWARG_PREFIX + f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_generate_kwargs(
        cls, kwargs: dict[str, Any], generation_config: Any = None
    ) -> tuple[BoleConfig, dict[str, Any]]:
        """Gathers tree settings from `generate`'s keyword arguments and its `GenerationConfig`.

        Precedence, highest first: `bole_<field>` keyword arguments, `bole_<field>` attributes of
        `generation_config`, the fields of a `bole_config=BoleConfig(...)` keyword argument, the defaults above.
        Unknown `bole_*` names are rejected with a suggestion, so a typo never silently falls back to a default.

        Args:
            kwargs (`dict[str, Any]`): `generate`'s keyword arguments; not modified.
            generation_config (`GenerationConfig`, *optional*): read for `bole_*` attributes.

        Returns:
            `(BoleConfig, dict)`: the settings, and `kwargs` without the `bole_*` entries.
        """
        base = kwargs.get(f"{KWARG_PREFIX}config")
        if base is not None and not isinstance(base, cls):
            raise ValueError(f"`{KWARG_PREFIX}config` must be a BoleConfig, got {type(base).__name__}")
        attributes = vars(generation_config) if generation_config is not None else {}
        from_config = {k: v for k, v in attributes.items() if k.startswith(KWARG_PREFIX)}
        from_kwargs = {k: v for k, v in kwargs.items() if k.startswith(KWARG_PREFIX)}
        known = cls.kwarg_names()
        for source, names in (("generate() argument", from_kwargs), ("GenerationConfig attribute", from_config)):
            for name in names:
                if name not in known:
                    close = difflib.get_close_matches(name, known, n=1)
                    hint = f" Did you mean `{close[0]}`?" if close else ""
                    raise ValueError(
                        f"Unknown hf_bole setting `{name}` (a {source}).{hint} Known settings: {', '.join(known)}"
                    )
        if f"{KWARG_PREFIX}config" in from_config:
            raise ValueError(f"`{KWARG_PREFIX}config` is a generate() argument, not a GenerationConfig attribute")

        # Not dataclasses.asdict: it deep-copies, and a drafter object must stay the caller's instance.
        settings = {f.name: getattr(base, f.name) for f in dataclasses.fields(cls)} if base is not None else {}
        for source in (from_config, from_kwargs):
            settings.update(
                {k.removeprefix(KWARG_PREFIX): v for k, v in source.items() if k != f"{KWARG_PREFIX}config"}
            )
        rest = {k: v for k, v in kwargs.items() if not k.startswith(KWARG_PREFIX)}
        return cls(**settings), rest
