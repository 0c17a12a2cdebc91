"""Tree-decoding settings: the one home of their defaults."""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedModel

VERIFY_MODES = ("closed_form", "serial")
ATTENTION_MODES = ("auto", "model", "triton")
PREFILL_MODES = ("auto", "chains", "plain")
BUILTIN_DRAFTERS = ("mtp", "ngram")
KWARG_PREFIX = "bole_"
AUTO_BUDGET = "auto"
# What `budget="auto"` verifies per round where no calibration table applies (no table for this model, GPU, dtype
# and verify mode; or not a CUDA device): this many draft nodes per request, at most FALLBACK_BUDGET_MAX
# across the batch (a forward of a few hundred tokens is compute-bound on current GPUs at every model size). 31: a
# request's tree then fills a verify width of 32 with its root, where one more node would double the kernels' tiles
# (`hf_bole.generation.budget.capacities`).
FALLBACK_BUDGET_PER_REQUEST = 31
FALLBACK_BUDGET_MAX = 128


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
        budget (`int` or `"auto"`, *optional*, defaults to `"auto"`):
            Draft nodes verified per round across the whole batch, the roots not counted (DESIGN.md §5), shared by
            cumulative draft probability. Every request with a draft still keeps its best root child when the
            budget is smaller than the batch. An int is a fixed budget; 0 verifies the roots alone, plain decoding
            through hf_bole's loop (no drafter is made). `"auto"` looks the budget up in the calibration table of
            this model, GPU, dtype and verify mode (`python -m hf_bole.calibrate`; see `hf_bole.generation.budget`)
            at the call's batch size (between two batch-size buckets, from the line between their timings) and the
            KV-length bucket at or below the longest active request, every round; it is 0 (plain decoding) where one
            draft node per request would cost a round more than `1 + epsilon` times plain decoding's. Without a
            table, or off CUDA, it uses `min(FALLBACK_BUDGET_PER_REQUEST * batch size, FALLBACK_BUDGET_MAX)` (31 per
            request, at most 128) and says so once in a log line. Either way a row never gets more nodes than at the
            full batch: as rows finish the budget shrinks with them, and no verify forward grows wider.
        epsilon (`float`, *optional*, defaults to 0.3):
            The slack of `budget="auto"`: the budget is the most nodes whose round (verify forward and commit) costs
            at most `(1 + epsilon)` times the least round that drafts, that of selection's floor (one node per
            request), `B_ver = max{N : T(N) <= (1 + epsilon) T(floor)}`, or 0 where the floor's round itself costs
            more than `(1 + epsilon)` times a round of the roots alone (`hf_bole.generation.budget.rule`). Tables store
            the raw timings, so any epsilon applies without measuring again (BENCHMARKS.md compares "auto" with fixed
            budgets).
        verify (`str`, *optional*, defaults to `"closed_form"`):
            How GDN layers verify the tree: `"closed_form"` (one solve over all nodes, state factors) or
            `"serial"` (node by node with a state snapshot per node, the SGLang-Tree baseline).
        attention (`str`, *optional*, defaults to `"auto"`):
            How full-attention layers attend in the verify forward: `"triton"` (`hf_bole.kernels.tree_attention`:
            the mask computed in the kernel from the cache's lengths and the tree, the grouped query heads read each
            key once, the committed keys split over programs and only the slots in use read; its torch reference
            off CUDA), `"model"` (the model's own attention, SDPA or eager, with the tree's ancestor mask as a 4D
            mask), or `"auto"`: `"triton"` on CUDA, `"model"` elsewhere (`resolve_attention`).
        drafter (`str`, `PreTrainedModel` or object, *optional*, defaults to `"mtp"`):
            `"mtp"` (the checkpoint's multi-token-prediction head), `"ngram"` (prompt lookup, no weights), a small
            causal LM sharing the target's tokenizer (`hf_bole.generation.drafters.model.ModelDrafter`; `generate`'s
            `assistant_model=` says the same), or any object with a `propose(ctx) -> DraftTree` method.
        ngram_max_size (`int`, *optional*, defaults to 3):
            The longest suffix the n-gram drafter looks up in the committed tokens.
        ngram_min_size (`int`, *optional*, defaults to 1):
            The shortest suffix it falls back to when longer ones never occurred before.
        cuda_graphs (`bool`, *optional*, defaults to `True`):
            On CUDA, replay the verify forward from one CUDA graph per tree-width bucket (`generation/verify.py`),
            node selection from one per tree shape and budget, and the MTP drafter's round (cache extension and tree
            expansion) from one per (batch size, new entries, tree size), instead of launching their kernels one by
            one from Python (on a small model the host's launches, not the GPU, set an eager round's pace). The first
            round of each width captures its graph, and again after the cache grew (a call makes room for 512
            generated tokens up front and doubles it as needed). The cache and graphs stay allocated for the next
            call of the same batch size and verify mode (the returned `past_key_values` is that cache: passed back,
            the next call continues it in place; otherwise the next call of that batch size starts it afresh);
            `hf_bole.release(model)` frees them, and with `False` none are kept. Mixture-of-experts layers are
            captured under transformers' `experts_implementation="grouped_mm"` (its default; bf16 weights only:
            torch's grouped_mm reads the routing on the host in other dtypes) or `"batched_mm"`; otherwise (as under
            `"eager"`, whose shapes depend on the routing) they run without graphs and say so once. No effect off CUDA.
        compile (`bool`, *optional*, defaults to `False`):
            Run the verify forward's decoder through `torch.compile`, which fuses the norms, gates and projections
            around hf_bole's tree kernels (custom ops in the one compiled graph). The first verify forwards of a
            model compile twice, static then with tree widths symbolic (seconds on a small model, minutes on a 9B
            one); with `cuda_graphs` the compiled forward is what the graphs capture. The MTP drafter's rounds
            compile too (its norms, rotary embedding and tree bookkeeping fused; compiling takes seconds). Compiled
            kernels round bf16 differently from the eager forward that plain `generate` runs, so at near-ties (the
            two best logits within a bf16 step) the output can differ from eager greedy, as transformers' own
            compiled decoding does.
        compile_drafter (`bool`, *optional*, defaults to `True`):
            On CUDA, run the MTP drafter's rounds (cache extension and tree expansion) through `torch.compile`, which
            fuses the head's norms, rotary embedding and the bookkeeping between its steps into fewer kernels; with
            `cuda_graphs` the compiled code is what the drafter's graphs capture. The output is the same either way:
            a draft only proposes, the target's verify forward decides. The first rounds compile a few times
            (seconds). No effect off CUDA, with another drafter, on a model spread over several devices, or with
            `compile=True` (which compiles the drafter's rounds too).
        fuse_projections (`bool`, *optional*, defaults to `True`):
            Run the projections of a layer that read one input (a GDN layer's four input projections, attention's
            q, k and v, the MLP's gate and up) as one GEMM in the verify forward and in the MTP drafter's head
            (`hf_bole/models/fused.py`). The first call makes their weights views of one buffer per layer: the model
            takes no more memory, its plain forward computes exactly as before, and `save_pretrained` still writes
            the weights one by one.
        prefill (`str`, *optional*, defaults to `"auto"`):
            How the prompt enters the cache. `"chains"`: as chains of at most 128 tokens through the verify forward,
            each committed whole (`hf_bole/generation/prefill.py`), replayed from its CUDA graphs where `cuda_graphs`
            applies. `"plain"`: transformers' forward over the prompt, its kernels launched from Python. `"auto"`:
            chains when the verify forward replays from graphs and the chains would re-read at most 72 GB of weights
            in all (`prefill.chain_limit`: at least 512 tokens; 512 on a 9B model) and a chain's round holds at most
            4 GiB for the whole batch (`prefill.CHAIN_PREFILL_ROUND_BYTES`: its factors and logits at every node; 23
            prompts on a 9B model), plain otherwise.
            "auto" takes plain, and "chains" raises a ValueError, for a batch chains would not prefill as
            transformers' forward does: padding after a row's first token (right padding, a hole in the mask; the
            forward runs it through the GDN layers), a row of padding alone, or position ids other than `generate`'s
            own (each row's tokens counted from 0); "auto" also with `verify="serial"`, which "chains" refuses. Both
            compute the same recurrence; their kernels round differently, like
            the verify forward's against plain decoding's. A chain's forward computes logits at every node, kept in
            its graph's memory: `[B, 128, vocab]`, 1 GiB at batch 16 with Qwen3.5's 248k-token vocabulary in bf16.
        pipeline (`bool`, *optional*, defaults to `True`):
            Queue each round on the device before the host reads the previous round's tokens, so that the host's
            per-round work (stopping rules, streaming, the next round's launches) overlaps the GPU's instead of
            leaving it idle. It applies with a drafter that declares `max_depth` (the MTP drafter does; see
            `hf_bole.Drafter`), logits processors that read no earlier tokens, and no stopping criteria beyond EOS,
            length and stop strings; other calls run rounds one after the other as with `False`. The output is the
            same either way. The price: a round launched after the last one was needed is computed and thrown away,
            a row that finished in a round drafts and verifies once more in the next (sharing the batch's budget),
            the cache holds one more round of slots, and with one request and no `cuda_graphs` the verify forward
            runs at the width of the round's budget instead of being cut to the nodes selected (a host read). With
            several rows the forward is still cut, a host read that then also waits for the round before.
        profile (`bool`, *optional*, defaults to `False`):
            Time every phase of every round (CUDA events, read once at the end; no synchronisation inside a round)
            and return the totals as `round_time_ms` with `return_dict_in_generate=True`, and each phase's time on
            the host clock, in its Python code, as `round_host_ms`.

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
    budget: int | str = AUTO_BUDGET
    epsilon: float = 0.3
    verify: str = "closed_form"
    attention: str = "auto"
    drafter: Any = "mtp"
    ngram_max_size: int = 3
    ngram_min_size: int = 1
    cuda_graphs: bool = True
    compile: bool = False
    compile_drafter: bool = True
    fuse_projections: bool = True
    prefill: str = "auto"
    pipeline: bool = True
    profile: bool = False

    def __post_init__(self):
        for name in ("depth", "topk", "ngram_max_size", "ngram_min_size"):
            if not _is_int_at_least(getattr(self, name), 1):
                raise ValueError(f"BoleConfig.{name} must be a positive int, got {getattr(self, name)!r}")
        if self.budget != AUTO_BUDGET and not _is_int_at_least(self.budget, 0):
            raise ValueError(
                f"BoleConfig.budget must be an int >= 0 (0: the roots alone, plain decoding) or {AUTO_BUDGET!r}, got "
                f"{self.budget!r}"
            )
        epsilon = self.epsilon
        if not isinstance(epsilon, (int, float)) or isinstance(epsilon, bool) or not 0 <= epsilon < float("inf"):
            raise ValueError(f"BoleConfig.epsilon must be a finite number >= 0, got {epsilon!r}")
        for name in ("cuda_graphs", "compile", "compile_drafter", "fuse_projections", "pipeline", "profile"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"BoleConfig.{name} must be True or False, got {getattr(self, name)!r}")
        if self.prefill not in PREFILL_MODES:
            raise ValueError(f"BoleConfig.prefill must be one of {PREFILL_MODES}, got {self.prefill!r}")
        if self.verify not in VERIFY_MODES:
            raise ValueError(f"BoleConfig.verify must be one of {VERIFY_MODES}, got {self.verify!r}")
        if self.attention not in ATTENTION_MODES:
            raise ValueError(f"BoleConfig.attention must be one of {ATTENTION_MODES}, got {self.attention!r}")
        if self.prefill == "chains" and self.verify == "serial":
            raise ValueError(
                "BoleConfig.prefill='chains' runs the prompt through the closed-form verify forward; verify='serial' "
                "would keep a state snapshot per prompt token: pass prefill='plain' or 'auto' with it"
            )
        if isinstance(self.drafter, str):
            if self.drafter not in BUILTIN_DRAFTERS:
                raise ValueError(
                    f"BoleConfig.drafter must be one of {BUILTIN_DRAFTERS} or an object with a "
                    f"`propose(ctx) -> DraftTree` method, got {self.drafter!r}"
                )
        elif isinstance(self.drafter, PreTrainedModel):
            pass  # a small-model drafter, checked against the target when the call starts
        elif isinstance(self.drafter, type):
            raise ValueError(
                f"BoleConfig.drafter must be a drafter object, got the class {self.drafter.__name__}: pass an "
                f"instance (e.g. {self.drafter.__name__}(...)), or 'ngram' for the n-gram drafter"
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


def resolve_attention(attention: str, device, kernel: bool = True) -> str:
    """`attention` (one of `ATTENTION_MODES`) for a verify forward on `device` (a `torch.device`): "auto" is
    "triton" on CUDA and "model" elsewhere (off CUDA the kernel's stand-in is a torch reference, not faster), and
    "model" for a model whose attention layers the kernel cannot take (`kernel=False`: the family's
    `tree_attention_kernel`), for which "triton" is refused."""
    if attention not in ATTENTION_MODES:
        raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {attention!r}")
    if attention == "triton" and not kernel:
        raise ValueError(
            "attention='triton' runs hf_bole's tree attention kernel, which this model's attention layers cannot use "
            "(the MLA layers of Kimi-Linear, Bailing-Hybrid and GLM-5-Next: query-key and value heads of different "
            "sizes; the indexed layers of Qwen4-Exp and GLM-5-Next, whose indexers narrow each query's mask); pass "
            "attention='model' or 'auto'"
        )
    if attention != "auto":
        return attention
    return "triton" if device.type == "cuda" and kernel else "model"


def _is_int_at_least(value: Any, least: int) -> bool:
    # bool is an int subclass: `bole_depth=True` is a mistake, not 1.
    return isinstance(value, int) and not isinstance(value, bool) and value >= least
