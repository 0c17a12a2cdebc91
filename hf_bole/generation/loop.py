"""The decoding loop: draft -> select -> verify -> accept -> commit, behind transformers' `custom_generate`.

    model.generate(input_ids, custom_generate="hf_bole")            after `import hf_bole`
    model.generate(input_ids, custom_generate=hf_bole.generate)     the callable form
    model.generate(input_ids, custom_generate="<repo with custom_generate/>", trust_remote_code=True)

One round (DESIGN.md §3) for the whole batch: the drafter proposes a tree per row; the batch-shared budget keeps
the best nodes by cumulative draft probability; one target forward verifies root + kept nodes of every row from
the committed state; greedy or lossless sampling acceptance walks each tree; the cache commits each row's
accepted path. Rows advance independently; output, stopping, padding and streaming follow plain `generate`
step for step. Before the first round the prompt enters the cache: through the verify forward as chains
(`generation/prefill.py`) or through transformers' forward over it.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import threading
import weakref
from dataclasses import dataclass

import torch
from transformers import Cache, GenerationConfig, PreTrainedModel
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerationMixin
from transformers.utils import logging

from hf_bole.cache import BoleCache
from hf_bole.config import BoleConfig, resolve_attention
from hf_bole.generation.accept_kernel import accept_greedy_kernel
from hf_bole.generation.acceptance import (
    accept_sampling,
    check_logits_processor,
    is_context_free,
    process_logits,
    sample_tokens,
)
from hf_bole.generation.budget import BudgetResolver
from hf_bole.generation.drafters import DraftContext, NgramDrafter
from hf_bole.generation.graphs import (
    CAPACITY_STEP,
    ShapeGraphs,
    captures,
    drop_graphs,
    graphed_cache,
    graphed_select,
    row_width,
    trimmed,
)
from hf_bole.generation.phases import PhaseTimer
from hf_bole.generation.prefill import chain_prefill, unchainable, use_chains, weight_bytes
from hf_bole.generation.select_kernel import select_round
from hf_bole.generation.tail import round_tail
from hf_bole.generation.tree import DraftTree
from hf_bole.kernels.tree_gdn.closed_form import MAX_NODES
from hf_bole.models import (
    Placement,
    attention_backends,
    cache_argument,
    check_supported_model,
    graph_unsafe_experts,
    placement,
    tree_forward,
)

logger = logging.get_logger(__name__)

CUSTOM_GENERATE_NAME = "hf_bole"
# Arguments of `GenerationMixin.generate` that transformers (5.17-5.25) does not forward to a `custom_generate`
# callable; the loop reads them from the calling frame so that a streamer still streams and an assistant model
# drafts.
_DROPPED_GENERATE_ARGS = ("streamer", "assistant_model", "synced_gpus")
_ASSISTANT_ERROR = (
    "hf_bole drafts with its own drafter: drop {name} and choose one with bole_drafter ('mtp', the checkpoint's "
    "MTP head; 'ngram', prompt lookup; a small causal LM sharing the tokenizer, also as assistant_model=; or an "
    "object with propose(ctx) -> DraftTree)"
)
# GenerationConfig settings that ask transformers for its own assisted decoding (some only in later versions).
_ASSISTED_SETTINGS = ("prompt_lookup_num_tokens", "assistant_early_exit", "use_mtp", "speculation_type")
_CACHE_ERROR = (
    "hf_bole builds its own BoleCache for every request and does not continue from a cache: drop {name}= (a cache "
    "returned by an earlier generate call included) and pass the whole conversation as input_ids"
)
# Names `generate` takes a cache by (5.17-5.25).
_CACHE_ARGS = ("cache", "past_key_values", "cache_params")
# Generated tokens a call makes room for up front (the cache's slots, the sequences' columns); longer calls grow them.
INITIAL_ROOM = CAPACITY_STEP
# Output options that would need per-step tensors of plain decoding (scores of finished rows and the like).
_UNSUPPORTED_OUTPUTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")


@dataclass
class BoleGenerateOutput(GenerateDecoderOnlyOutput):
    r"""
    `GenerateDecoderOnlyOutput` plus how well the tree drafts did (`return_dict_in_generate=True`).

    Args:
        accept_lengths (`torch.LongTensor` of shape `(batch_size, num_rounds)`):
            Tokens each verify round accepted per row, the bonus token included; 0 where the row sat the round out
            (finished). A row's last round may accept past `max_new_tokens` or a stop, where the output is cut; the
            first generated token comes from the prefill and is not counted.
        mean_accepted_tokens (`float`):
            Accepted tokens per verify round over all rows' rounds.
        peak_transient_bytes (`dict[str, int]`):
            The largest per-round tree state of the call (`BoleCache.transient_bytes` of its biggest round): GDN
            factors or per-node snapshots, pre-conv inputs, tree KV.
        round_time_ms (`dict[str, float]`, *optional*):
            With `bole_profile=True`: milliseconds spent in each phase of the rounds (draft, select, verify, accept,
            commit, host), summed over the rounds, and `rounds` (pipelined, one more than `accept_lengths` holds:
            the round launched before the last one was read); see `hf_bole.generation.phases.PhaseTimer`. Greedy
            decoding without logits processors under `bole_cuda_graphs` replays acceptance, commit and the drafter's
            next inputs from one graph (`graphs.TailGraphs`): "accept" holds all of it and "commit" nothing.
        round_host_ms (`dict[str, float]`, *optional*):
            With `bole_profile=True`: the same phases' time on the host clock, in their Python code (on CUDA a phase
            whose host time exceeds its `round_time_ms` kept the GPU waiting once the host fell behind).
    """

    accept_lengths: torch.LongTensor | None = None
    mean_accepted_tokens: float | None = None
    peak_transient_bytes: dict[str, int] | None = None
    round_time_ms: dict[str, float] | None = None
    round_host_ms: dict[str, float] | None = None


def _caller_generate_frame():
    """The frame of transformers' `GenerationMixin.generate` that called `generate`, if it did."""
    frame = sys._getframe(2)
    # `generate` sits under decorators (no_grad; deprecation shims from transformers 5.24): compare with the
    # innermost function's code.
    if frame.f_code is inspect.unwrap(GenerationMixin.generate).__code__:
        return frame
    return None


def generate(model, *args, **kwargs):
    r"""
    Generates like `model.generate`, with exact tree speculative decoding (the hf_bole `custom_generate`).

    Takes everything `model.generate` takes (GenerationConfig, logits processors, stopping criteria, stop strings,
    streamers, left-padded batches, sampling), plus the tree settings of [`BoleConfig`] as `bole_<field>`
    keyword arguments (or `GenerationConfig` attributes): `bole_depth`, `bole_topk`, `bole_budget`,
    `bole_verify`, `bole_drafter`, ... Greedy output equals plain `generate` token for token; sampling keeps the
    model's distribution. Calls with one model from several threads run one at a time (they share what hf_bole keeps
    for the model); plain forwards of the model in other threads meanwhile compute what they always do.

    Returns:
        What `model.generate` returns; with `return_dict_in_generate=True` a [`BoleGenerateOutput`], which adds
        `accept_lengths` and `mean_accepted_tokens`.

    Example:

    ```python
    >>> import hf_bole
    >>> out = model.generate(input_ids, max_new_tokens=64, custom_generate="hf_bole", bole_drafter="ngram")
    >>> out = model.generate(input_ids, max_new_tokens=64, custom_generate=hf_bole.generate)
    ```
    """
    frame = _caller_generate_frame()
    if frame is not None and callable(frame.f_locals.get("custom_generate")):
        # Called by `model.generate` as the decoding method: inputs, processors and criteria are prepared.
        dropped = {name: frame.f_locals.get(name) for name in _DROPPED_GENERATE_ARGS}
        kwargs.pop("tokenizer", None)  # stop strings are criteria by now (see `install_generate_hooks`)
        # Under `torch.inference_mode()` too, the call makes normal tensors: what it keeps for the model's next calls
        # (caches, graphs, the MTP drafter, fused weights) must take their in-place writes outside inference mode.
        with _model_lock(model), torch.inference_mode(False):
            return _decode(model, *args, **kwargs, **dropped)
    # Called with `model.generate`'s own arguments (directly, by name, or from a Hub folder): let transformers
    # prepare them and call back as the decoding method.
    kwargs.pop("custom_generate", None)
    kwargs.pop("trust_remote_code", None)
    # Settings are read again in `_decode`; checking them here names a misspelt `bole_*` argument, which
    # transformers would only report as an unused model kwarg.
    _assistant_drafter(kwargs.pop("assistant_model", None), kwargs)
    BoleConfig.from_generate_kwargs(kwargs, kwargs.get("generation_config"))
    # transformers would refuse these with a less helpful message, or run without them.
    _check_assisted(kwargs, kwargs.get("generation_config"), model.generation_config)
    _check_cache_args(kwargs)
    return model.generate(*args, custom_generate=generate, **kwargs)


# transformers forwards to a custom_generate callable only the keyword arguments its signature names, beyond
# those of `_sample`: list every `bole_*` setting.
generate.__signature__ = inspect.Signature(
    [
        inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL),
        *(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None) for name in BoleConfig.kwarg_names()),
        inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD),
    ]
)


def install_generate_hooks() -> None:
    """Three hooks on transformers' `GenerationMixin` (5.17-5.25), installed once by `import hf_bole`:

    - `model.generate(..., custom_generate="hf_bole")` resolves to `generate` from any working directory and without
      `trust_remote_code` (the name is intercepted before transformers looks for a folder or Hub repo);
    - `tokenizer=` reaches the stopping criteria when `custom_generate` is hf_bole's callable: transformers drops it
      for every callable, so stop strings would fail with "could not locate a tokenizer"; arguments asking for
      transformers' assisted decoding without a model are refused with hf_bole's message before transformers checks
      them; and `assistant_model=` becomes hf_bole's drafter (`bole_drafter`);
    - such a call is not taken for transformers' assisted decoding when transformers validates the generation mode
      (5.17-5.24 refuse that for stateful models; 5.25 would check the assistant's tokenizer).
    """
    load = GenerationMixin.load_custom_generate
    if getattr(load, "__hf_bole_original__", None) is None:

        @functools.wraps(load)
        def load_custom_generate(self, pretrained_model_name_or_path=None, trust_remote_code=None, **kwargs):
            if pretrained_model_name_or_path == CUSTOM_GENERATE_NAME:
                return generate
            return load(self, pretrained_model_name_or_path, trust_remote_code=trust_remote_code, **kwargs)

        load_custom_generate.__hf_bole_original__ = load
        GenerationMixin.load_custom_generate = load_custom_generate

    extract = getattr(GenerationMixin, "_extract_generation_mode_kwargs", None)  # 5.17-5.25 have it
    if extract is not None and getattr(extract, "__hf_bole_original__", None) is None:

        @functools.wraps(extract)
        def extract_generation_mode_kwargs(self, custom_generate, kwargs, *args, **more):
            if custom_generate is generate:
                # Before transformers checks the generation mode (5.17-5.24 refuse assisted decoding of stateful
                # models with their own message): the arguments of the `generate` call making it.
                frame = sys._getframe(1)
                passed = frame.f_locals if frame.f_code is inspect.unwrap(GenerationMixin.generate).__code__ else {}
                _check_assisted(kwargs, passed.get("generation_config"), self.generation_config)
                _check_cache_args(kwargs)
            tokenizer = kwargs.get("tokenizer")
            extracted = extract(self, custom_generate, kwargs, *args, **more)
            if custom_generate is generate:
                _assistant_drafter(more.get("assistant_model", args[1] if len(args) > 1 else None), extracted)
                if tokenizer is not None:
                    extracted["tokenizer"] = tokenizer
            return extracted

        extract_generation_mode_kwargs.__hf_bole_original__ = extract
        GenerationMixin._extract_generation_mode_kwargs = extract_generation_mode_kwargs

    validate = GenerationMixin._validate_generation_mode
    if getattr(validate, "__hf_bole_original__", None) is None:

        @functools.wraps(validate)
        def validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs, *args, **more):
            # hf_bole's call with assistant_model= (its drafter now, `_assistant_drafter`): not transformers' assisted
            # decoding, which 5.17-5.24 refuse for stateful models
            if isinstance(generation_mode_kwargs.get("bole_drafter"), PreTrainedModel):
                generation_mode = generation_config.get_generation_mode()
            return validate(self, generation_mode, generation_config, generation_mode_kwargs, *args, **more)

        validate_generation_mode.__hf_bole_original__ = validate
        GenerationMixin._validate_generation_mode = validate_generation_mode


_MTP_DRAFTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def release(model) -> None:
    """Frees what hf_bole keeps on the device for `model` between `generate` calls: the tree caches and CUDA graphs
    of `bole_cuda_graphs` (one cache per batch size, as long as its longest call) and the MTP drafter with its own
    cache and graphs. The next call builds them again.

    Example:

    ```python
    >>> out = model.generate(input_ids, custom_generate="hf_bole", max_new_tokens=256)
    >>> hf_bole.release(model)  # before loading something else onto the GPU
    ```
    """
    with _model_lock(model):
        drop_graphs(model)
        _MTP_DRAFTERS.pop(model, None)
        _WRITES.pop(model, None)


# model -> the lock its `generate` calls hold, one call at a time: they share what hf_bole keeps for the model (the
# kept caches and graphs, the token writes, the MTP drafter with its cache).
_LOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCKS_LOCK = threading.Lock()


def _model_lock(model) -> threading.RLock:
    with _LOCKS_LOCK:
        if model not in _LOCKS:
            _LOCKS[model] = threading.RLock()
        return _LOCKS[model]


def _make_drafter(model, config: BoleConfig, device: torch.device):
    if isinstance(config.drafter, PreTrainedModel):  # a small model: its own state per call (drafters/model.py)
        from hf_bole.generation.drafters.model import ModelDrafter

        return ModelDrafter(config.drafter, model, depth=config.depth, topk=config.topk)
    if config.drafter == "ngram":
        return NgramDrafter(config)
    if config.drafter == "mtp":
        # Loading the head reads the checkpoint: keep one per model (and tree shape) across generate calls.
        from hf_bole.generation.drafters.mtp import MTPDrafter

        # Compiled drafting proposes what eager drafting does up to rounding, and the verify forward decides.
        compiled = config.compile or (config.compile_drafter and device.type == "cuda")
        # Settings it cannot run are named as such, not as the missing weights below.
        MTPDrafter.check_settings(
            model.config.get_text_config(decoder=True), config.depth, config.topk,
            model.get_output_embeddings().weight.shape[0],
        )  # fmt: skip
        per_model = _MTP_DRAFTERS.setdefault(model, {})
        key = (config.depth, config.topk, config.cuda_graphs, compiled, config.fuse_projections)
        if key not in per_model:
            try:
                per_model[key] = MTPDrafter.from_model(
                    model, depth=config.depth, topk=config.topk, cuda_graphs=config.cuda_graphs, compile=compiled,
                    fuse_projections=config.fuse_projections,
                )
            except ValueError as e:
                raise ValueError(
                    f"the default drafter runs the checkpoint's MTP head (`mtp.*` weights), which this model lacks: "
                    f"{e} Pass bole_drafter='ngram' (needs no weights) or a drafter object instead."
                ) from e
        return per_model[key]
    return config.drafter


def _check_request(model, generation_config: GenerationConfig, model_kwargs: dict, dropped: dict) -> None:
    check_supported_model(model)
    if generation_config.num_beams != 1:
        raise ValueError(f"hf_bole decodes one sequence per row; num_beams={generation_config.num_beams} is not supported")
    if generation_config.num_return_sequences not in (None, 1):
        raise ValueError("hf_bole returns one sequence per row; repeat the prompts instead of num_return_sequences")
    _check_assisted({}, generation_config)
    if dropped.get("synced_gpus"):
        raise ValueError("hf_bole does not support synced_gpus (DeepSpeed ZeRO-3 / FSDP generation)")
    for flag in _UNSUPPORTED_OUTPUTS:
        if getattr(generation_config, flag, False):
            raise ValueError(f"hf_bole does not return per-step tensors: {flag}=True is not supported")
    # `generate` puts a fresh cache of its own here, under `cache` (5.24 on) or `past_key_values`; one the user
    # passed, under either name, carries `_is_user_defined`.
    for name, value in model_kwargs.items():
        if isinstance(value, Cache) and getattr(value, "_is_user_defined", False):
            raise ValueError(_CACHE_ERROR.format(name=name))
    if model_kwargs.get("inputs_embeds") is not None:
        raise ValueError("hf_bole needs input_ids (it drafts and verifies tokens); inputs_embeds is not supported")
    for key in ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw"):
        if model_kwargs.get(key) is not None:
            raise ValueError(f"hf_bole verifies text-only requests; `{key}` is not supported")


def _check_cache_args(kwargs: dict) -> None:
    """Refuses a cache among `generate`'s keyword arguments `kwargs`, by any name a transformers version takes."""
    for name in _CACHE_ARGS:
        if kwargs.get(name) is not None:
            raise ValueError(_CACHE_ERROR.format(name=name))


def _assistant_drafter(assistant_model, kwargs: dict) -> None:
    """`assistant_model=` is `bole_drafter=`: puts the assistant into `kwargs` (`generate`'s keyword arguments) as
    hf_bole's drafter; refuses it next to another `bole_drafter`."""
    if assistant_model is None:
        return
    if kwargs.get("bole_drafter") not in (None, assistant_model):
        raise ValueError(
            "assistant_model= and bole_drafter= both name a drafter: pass one (assistant_model=small is "
            "bole_drafter=small)"
        )
    kwargs["bole_drafter"] = assistant_model


def _check_assisted(kwargs: dict, *configs) -> None:
    """Refuses settings of `kwargs` or `configs` (GenerationConfigs, or None) that ask for transformers' assisted
    decoding without a model (prompt lookup, early exit, MTP)."""
    for name in _ASSISTED_SETTINGS:
        values = [kwargs.get(name)] + [getattr(config, name, None) for config in configs if config is not None]
        if any(value not in (None, False) for value in values):
            raise ValueError(_ASSISTANT_ERROR.format(name=name))


class _Stopping:
    """Plain `generate`'s stopping rules applied token by token to rows that advance at different speeds.

    EOS and length criteria are checked on the host from the emitted token ids. Stop strings look only at the last
    `maximum_token_len` tokens of a row: `_suffix_stops` checks every new token of every row in one call per round
    over those windows. Any other criterion (user criteria) is called exactly as plain decoding calls it, with the
    row's full `input_ids`, token by token.
    """

    def __init__(self, criteria: StoppingCriteriaList, prompt_length: int):
        self.max_lengths = [c.max_length for c in criteria if isinstance(c, MaxLengthCriteria)]
        # one host read per criterion (the ids sit on the device), not one per id
        self.eos = {t for c in criteria if isinstance(c, EosTokenCriteria) for t in c.eos_token_id.flatten().tolist()}
        others = [c for c in criteria if not isinstance(c, (MaxLengthCriteria, EosTokenCriteria))]
        suffix = [c for c in others if isinstance(c, StopStringCriteria)]
        self.window = max((c.maximum_token_len for c in suffix), default=0)
        # A window reaching before the first column would see tokens plain decoding's shorter input_ids lack: with
        # prompts shorter than the longest stop string, those criteria are called token by token too.
        self.suffix = suffix if prompt_length + 1 >= self.window else []
        self.others = StoppingCriteriaList([c for c in others if not any(c is s for s in self.suffix)])
        # Plain decoding pads a finished row only when some criterion knows an EOS token (`_sample`).
        self.pads_finished = any(hasattr(c, "eos_token_id") for c in criteria)

    def first_stop(self, tokens: list[int], length: int, suffix: list[int] | None, row_ids) -> int | None:
        """The index of the first of a row's new `tokens` after which it stops, or None: its sequence is `length`
        long before them, `row_ids(n)` gives its first `n` ids as [1, n], and `suffix[j]` is what `_suffix_stops`
        said of token j (None without stop strings). Other criteria are called token by token with the row's ids, as
        plain decoding calls them, up to the stop."""
        reach = min((m - length - 1 for m in self.max_lengths), default=len(tokens))  # the token reaching a length
        for j, token in enumerate(tokens):
            if j >= reach or token in self.eos or (suffix is not None and suffix[j]):
                return j
            if self.others and bool(self.others(row_ids(length + j + 1), None).any()):
                return j
        return None


@torch.no_grad()
@attention_backends()  # SDPA without cuDNN for the whole call: it re-plans for every new key length
def _decode(
    model,
    input_ids: torch.LongTensor,
    logits_processor=None,
    stopping_criteria: StoppingCriteriaList | None = None,
    generation_config: GenerationConfig | None = None,
    streamer=None,
    assistant_model=None,
    synced_gpus=None,
    **model_kwargs,
):
    generation_config = generation_config if generation_config is not None else model.generation_config
    _assistant_drafter(assistant_model, model_kwargs)
    bole, model_kwargs = BoleConfig.from_generate_kwargs(
        {k: v for k, v in model_kwargs.items() if v is not None or not k.startswith("bole_")}, generation_config
    )
    _check_request(model, generation_config, model_kwargs, {"assistant_model": assistant_model, "synced_gpus": synced_gpus})
    place = placement(model)
    bole = _spread_settings(bole, place)
    # "auto" attention, settled once for the call: the graphs, the budget table and the forwards are keyed by it.
    bole = dataclasses.replace(bole, attention=resolve_attention(bole.attention, place.layer_devices[0]))
    check_logits_processor(logits_processor)
    stopping = _Stopping(stopping_criteria or StoppingCriteriaList(), input_ids.shape[1])
    do_sample = bool(generation_config.do_sample)
    pad_token = generation_config._pad_token_tensor
    pad_token = int(pad_token) if pad_token is not None else 0

    # The loop runs where the logits come out (the LM head's device); the prompt goes in at the embedding's, the
    # tree's parents and accepted paths to the cache's (the first layer's). All three are one device unless the
    # model is spread over several by accelerate's device_map.
    device, in_device = place.output_device, place.input_device
    input_ids = input_ids.to(device)
    B, P = input_ids.shape
    if P == 0:
        raise ValueError(
            f"hf_bole continues a prompt: input_ids has {B} rows of 0 tokens; give every row at least one token "
            f"(e.g. the tokenizer's BOS token)"
        )
    max_new = generation_config.max_length - P
    attention_mask = model_kwargs.get("attention_mask")
    if attention_mask is not None:
        attention_mask = attention_mask.to(in_device)
    mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.to(device).bool()
    counted = (mask.long().cumsum(-1) - 1).clamp(min=0)  # [B, P] each token's place among its row's tokens
    position_ids = model_kwargs.get("position_ids")
    position_ids = counted if position_ids is None else position_ids.to(device)
    text_positions = position_ids[0] if position_ids.dim() == 3 else position_ids

    row_cap = MAX_NODES - 1  # the kernels verify at most MAX_NODES nodes per tree, the root included
    # The budget of each round: fixed, or looked up by active rows and KV length ("auto", generation/budget.py).
    budget_for = BudgetResolver.for_model(model, bole, B)
    per_row = max(1, min(row_cap, budget_for.max_budget))
    drafter = _make_drafter(model, bole, device)
    builtin_drafter = isinstance(bole.drafter, (str, PreTrainedModel))  # a user's drafter gets its trees checked
    max_depth = _max_depth(drafter)
    vocab_size = model.get_output_embeddings().weight.shape[0]
    graphed = captures(model, bole.cuda_graphs)
    # Pipelined rounds (`BoleConfig.pipeline`): round r + 1 is queued before the host reads round r's tokens. Every
    # launch of a round must then need nothing from the host that round r decides: a drafter that reads no host-side
    # sequences, no processor or criterion reading ids. Rows that finished in round r draft and verify once more in
    # round r + 1 (the host does not know yet); what they commit is never read.
    pipelined = bole.pipeline and max_depth is not None and is_context_free(logits_processor) and not stopping.others
    # The most tokens one round commits per row (its accepted path), and how many rounds the host may lag behind.
    step = max_depth + 1 if max_depth is not None else per_row + 1
    lag = 1 if pipelined else 0

    # Room for the first `room` generated tokens: committed slots then reach prompt + room + one round's overshoot
    # per round in flight, and the tree needs per_row + 1 more. Past it the cache and the sequences grow (doubling),
    # so that a call takes memory and time for the tokens it generates, not for max_new_tokens.
    room = min(max_new, INITIAL_ROOM)
    capacity = P + room + (1 + lag) * step + per_row + 1
    chains = use_chains(bole.prefill, graphed, P, bole.verify, weight_bytes(model))
    reason = unchainable(mask, position_ids) if chains else None
    if reason is not None and bole.prefill == "chains":
        raise ValueError(
            f"bole_prefill='chains' would not prefill this batch as transformers' forward does: {reason}; pass "
            f"bole_prefill='plain' (or 'auto', which chooses it here)"
        )
    chains = chains and reason is None
    # Read before the prefill is queued, not after: a read then would wait for it.
    prompt_columns = None if pipelined else _prompt_columns(mask)
    if chains:
        capacity += MAX_NODES  # a prefill chain's tree, committed or not, takes the slots after the tokens before it
    if bole.cuda_graphs and device.type == "cuda" and not graphed:  # captures() refuses some experts
        logger.warning_once(
            f"hf_bole: CUDA graphs cannot capture the model's mixture-of-experts layers "
            f"({graph_unsafe_experts(model)[0]}, ...): eager experts route tokens on the host, and torch's grouped_mm "
            f"does outside bf16. Its verify forwards run without graphs, launched from Python. To replay them from "
            f"graphs load the model in bf16 with experts_implementation='grouped_mm' (transformers' default), or "
            f"call model.set_experts_implementation('batched_mm'); bole_cuda_graphs=False says the same without this "
            f"warning"
        )
    if graphed:  # a cache kept across calls, whose verify forwards replay from CUDA graphs (generation/graphs.py)
        cache, verify_forward = graphed_cache(
            model, B, capacity, bole.verify, bole.compile, bole.fuse_projections, bole.attention
        )
        select = graphed_select(model)
        # Greedy without processors reads nothing but the logits: the round's tail replays from a graph too.
        tails = verify_forward.tail if not do_sample and not logits_processor else None
    else:
        cache = BoleCache.for_model(model, B)  # grows on demand
        cache.reserve(capacity)
        verify_forward = functools.partial(
            tree_forward, model, cache, verify=bole.verify, compile=bole.compile,
            fuse_projections=bole.fuse_projections, attention=bole.attention,
        )  # fmt: skip
        select = select_round
        tails = None
    if chains:  # the prompt through the verify forward (generation/prefill.py)
        commit = verify_forward.commit if graphed else None  # replayed from graphs with the verify forwards
        hidden = chain_prefill(verify_forward, cache, input_ids, mask, pad_token, commit).to(device)  # [B, P, hidden]
    else:
        decoder = model.get_decoder()
        prefill = decoder(
            input_ids=input_ids.to(in_device),
            attention_mask=attention_mask,
            position_ids=position_ids.to(in_device),
            use_cache=True,
            **{cache_argument(type(decoder).forward): cache},
        )
        hidden = prefill.last_hidden_state.to(device)  # [B, P, hidden]
    logits = model.get_output_embeddings()(hidden[:, -1]).float()  # [B, V]
    scores = logits_processor(input_ids, logits) if logits_processor else logits
    first = sample_tokens(scores) if do_sample else scores.argmax(-1)  # [B]

    # writes.seq: every row as plain decoding's `input_ids` holds it (`_Writes`), with room for a round past `room`
    writes = _Writes.for_call(
        model, input_ids, P + room + lag * step + per_row + 3, pad_token, stopping, graphed and device.type == "cuda"
    )
    prompt_lengths = mask.sum(-1)  # [B] on the device
    state = _Rows(B, P, max_new, stopping, writes)
    # The first token is read like a round's tokens: pipelined, after the first round is queued (behind the prefill).
    queued = [_Queued(state.write(first[:, None], torch.ones(B, dtype=torch.long, device=device)), None, round=False)]
    streamed = _Streamer(streamer, state)
    while len(queued) > lag:
        _finish(state, queued.pop(0), drafter, max_depth, vocab_size)
        streamed.flush()

    # What the drafter has not seen yet: the prompt's hidden states, each followed by its next token.
    new_hidden = hidden
    new_tokens = torch.cat([input_ids[:, 1:], first[:, None]], dim=1)
    new_mask, new_positions = mask, text_positions
    root = first
    rounds: list[list[int]] = []  # per round, the tokens each row accepted (0: it sat the round out)
    peak_transient = dict.fromkeys(cache.transient_bytes, 0)  # the rounds' tree state (prefill chains not counted)
    timer = PhaseTimer(device, enabled=bole.profile)
    uploaded = None  # the `active` list `active_t` [B] holds on the device
    while True:
        active = state.active()
        if not any(active):
            if not queued:
                break
            # Rows finished in a round read after the last launch: what is still queued was not needed.
            for q in queued:
                _finish(state, q, drafter, max_depth, vocab_size)
            queued.clear()
            continue
        timer.round_start()
        if active != uploaded:  # made again only when a row finishes
            uploaded, active_t = active, _upload(active, device)
        # Upper bounds from the host's counts, which lag the device by the rounds still queued.
        longest = max(n for n, a in zip(state.n_gen, active) if a) + step * len(queued)
        ctx = DraftContext(
            sequences=None if pipelined else _sequences(writes.seq, prompt_columns, P, state.n_gen),
            max_nodes=per_row,
            hidden_states=new_hidden,
            next_tokens=new_tokens,
            new_mask=new_mask,
            positions=new_positions,
            lengths=prompt_lengths + state.generated,
            max_length=P + longest + step,
        )
        tree = drafter.propose(ctx)
        timer.mark("draft")
        tree_copy, safe = None, None
        if not builtin_drafter:
            if pipelined:  # checked a round late on a host copy; verified now in a form no kernel can trip over
                _check_custom_tree(tree, B, vocab_size, drafter, max_depth, values=False)
                tree_copy = DraftTree(*(x.to("cpu", non_blocking=True) for x in (tree.tokens, tree.parents, tree.draft_logprobs)))
                safe = (vocab_size, max_depth)  # made safe inside selection (its graph, where one replays it)
            else:
                _check_custom_tree(tree, B, vocab_size, drafter, max_depth)
        tree = DraftTree(*(x.to(device) for x in (tree.tokens, tree.parents, tree.draft_logprobs)))
        # Rows that are done verify their root only (their draft gets no budget, `active_t`) and commit nothing. The
        # committed KV of the longest active row (left padding included), from host-side counts: no device read.
        rows = sum(active)
        budget = budget_for(rows, P - 1 + longest)
        # Each row keeps at most what its forward's width holds, chosen from the budget (`row_width`), not read back.
        verify = select(tree, root, budget, row_width(budget, rows, per_row + 1) - 1, active_t, safe)
        budget_for.observe(verify)  # the goodput rule's draft probabilities (selection ranked them), read next round
        if not graphed and (rows > 1 or not pipelined):
            # Launched from Python, the forward may run at the widest row's exact width; the read that takes waits for
            # drafting and selection, which a pipelined round of one row skips.
            verify = trimmed(verify)
        timer.mark("select")
        out = verify_forward(verify.input_ids, verify.parents.to(cache.device))
        timer.mark("verify")
        peak_transient = max(peak_transient, cache.transient_bytes, key=lambda t: sum(t.values()))
        # The drafter's next inputs keep one shape from round to round (one CUDA graph) with `max_depth`: `step`
        # columns.
        width = step if max_depth is not None else None
        if tails is not None:  # acceptance, commit and the drafter's next inputs: one replay (`TailGraphs`)
            tail = tails(verify, out, active_t, step, width)
            timer.mark("accept")
            timer.mark("commit")
        else:
            contexts = None
            if not is_context_free(logits_processor):
                contexts = [writes.seq[b, : P + state.n_gen[b]] for b in range(B)]
            if do_sample:
                accepted = accept_sampling(verify, process_logits(logits_processor, out.logits, verify, contexts))
            else:
                # Greedy reads only the argmax, which the processors' fp32 copy of the logits would not move: without
                # processors it is taken on the logits themselves (a [B, T, V] copy saved: 32 MB a round at batch 1
                # on the 9B shape's 32 nodes).
                scores = process_logits(logits_processor, out.logits, verify, contexts) if logits_processor else out.logits
                accepted = accept_greedy_kernel(verify, scores.argmax(-1))
            timer.mark("accept")
            tail = round_tail(cache, accepted, out.hidden_states, active_t, step, width)
            timer.mark("commit")

        queued.append(_Queued(state.write(tail.tokens, tail.lengths), tree_copy))
        new_hidden, new_tokens, new_mask, new_positions = tail.hidden, tail.next_tokens, tail.mask, tail.positions
        root = tail.root
        # Read what the host may no longer wait for: every round but the last `lag` ones.
        while len(queued) > lag:
            q = queued.pop(0)
            accepted_counts = _finish(state, q, drafter, max_depth, vocab_size)
            if q.round:
                rounds.append(accepted_counts)
            streamed.flush()
        timer.mark("host")

    T_out = state.output_length()
    streamed.flush(T_out, final=True)
    sequences = state.sequences(T_out)
    if not generation_config.return_dict_in_generate:
        return sequences
    accept_lengths = torch.tensor(rounds, dtype=torch.long, device=device).view(len(rounds), B).T
    played = (accept_lengths > 0).sum()
    mean = float(accept_lengths.sum() / played) if played > 0 else 0.0
    return BoleGenerateOutput(
        sequences=sequences,
        past_key_values=cache,
        accept_lengths=accept_lengths,
        mean_accepted_tokens=mean,
        peak_transient_bytes=peak_transient,
        round_time_ms=timer.totals_ms(),
        round_host_ms=timer.host_totals_ms(),
    )


def _spread_settings(bole: BoleConfig, place: Placement) -> BoleConfig:
    """`bole` for a model spread over several devices (accelerate's `device_map`): refuses `compile` and turns CUDA
    graphs and the drafter's compile off, saying so once (a graph is captured on one device's stream; compiled
    drafting there, whose embedding and rotary embedding run on other devices, was never run)."""
    if not place.spans_devices:
        return bole
    devices = ", ".join(map(str, place.devices))
    if bole.compile:
        raise ValueError(
            f"bole_compile=True compiles the verify forward into one graph on one device, but this model is spread "
            f"over {len(place.devices)} devices ({devices}) by its device_map; drop bole_compile (or load the model on "
            f"one device)"
        )
    if (bole.cuda_graphs or bole.compile_drafter) and any(d.type == "cuda" for d in place.devices):
        logger.warning_once(
            f"hf_bole: CUDA graphs and the drafter's compile are off: the model spans {len(place.devices)} devices "
            f"({devices}); verify forwards and MTP drafting launch their kernels from Python (bole_cuda_graphs=False "
            f"and bole_compile_drafter=False say the same without this warning)"
        )
    return dataclasses.replace(bole, cuda_graphs=False, compile_drafter=False)


def _max_depth(drafter) -> int | None:
    """The drafter's `max_depth` (see `Drafter`), or None when it declares none."""
    depth = getattr(drafter, "max_depth", None)
    if depth is not None and (not isinstance(depth, int) or isinstance(depth, bool) or depth < 1):
        raise ValueError(
            f"{type(drafter).__name__}.max_depth must be a positive int (the most levels its trees hold below the "
            f"root) or absent, got {depth!r}"
        )
    return depth


def _check_custom_tree(tree, batch_size: int, vocab_size: int, drafter, max_depth: int | None, values=True) -> None:
    """Raises a ValueError naming the drafter when `tree` is not a valid DraftTree; with `values=False` only what
    needs no read of the tree's values (its type, dtypes, shapes and devices)."""
    if not isinstance(tree, DraftTree):
        raise ValueError(f"{type(drafter).__name__}.propose must return a hf_bole.DraftTree, got {type(tree).__name__}")
    try:
        if values:
            tree.validate(batch_size, vocab_size, max_depth)
        else:
            tree.check_layout(batch_size)
    except ValueError as e:
        raise ValueError(f"{type(drafter).__name__}.propose returned an invalid DraftTree: {e}") from e


@dataclass
class _Queued:
    """A round (or the prefill's first token) queued on the GPU: its tokens on their way to the host (`_Rows.write`),
    and with a pipelined custom drafter a host copy of the tree it proposed, checked when the round is read."""

    tokens: _Written
    tree: DraftTree | None
    round: bool = True  # False for the first token, which the prefill gives


def _finish(state: _Rows, queued: _Queued, drafter, max_depth: int | None, vocab_size: int) -> list[int]:
    """Reads a queued round on the host (waiting for it): checks its tree, then emits its tokens; returns how many
    tokens each row accepted (0 for a row that sat it out)."""
    if queued.tree is not None:
        queued.tokens.ready.synchronize()  # the tree's copy was queued before the round's tokens
        _check_custom_tree(queued.tree, state.B, vocab_size, drafter, max_depth)
    return state.read(queued.tokens)


class _Rows:
    """Host-side bookkeeping of every row: tokens generated, where it finished, whether it still decodes."""

    def __init__(self, B: int, P: int, max_new: int, stopping: _Stopping, writes: _Writes):
        self.B, self.P, self.max_new, self.stopping, self.pad = B, P, max_new, stopping, writes.pad
        self.writes, self.generated = writes, writes.generated
        self.n_gen = [0] * B
        # What the writes' sequences may hold, on the host: each row's tokens written as far as read, and the widths
        # of the writes not read yet (`_Writes.reserve` keeps room for them).
        self.written = [0] * B
        self.unread = 0
        self.tokens: list[list[int]] = [[] for _ in range(B)]
        self.finished_at: list[int | None] = [None] * B  # generated length when a stopping criterion fired
        self.frozen = [False] * B  # finished and padded from then on, as plain decoding does with an EOS criterion

    @property
    def seq(self) -> torch.Tensor:
        """`[B, width]` every row's sequence on the device (`_Writes.seq`: a wider copy after it grew)."""
        return self.writes.seq

    def limit(self) -> int:
        """How many tokens rows need: `max_new`, or, once every row has finished, the last one to finish
        (plain decoding stops there; rows that are not padded keep producing real tokens until then)."""
        if all(f is not None for f in self.finished_at):
            return max(self.finished_at)
        return self.max_new

    def active(self) -> list[bool]:
        limit = self.limit()
        return [not self.frozen[b] and self.n_gen[b] < limit for b in range(self.B)]

    def write(self, tokens: torch.Tensor, lengths: torch.Tensor) -> _Written:
        """Appends `tokens[b, :lengths[b]]` (`[B, L]` and `[B]` on the device) to every row of `seq` on the device
        and starts copying them, with what the stop strings say of them, to the host; `read` takes them from
        there. Reads nothing on the host."""
        self.unread += tokens.shape[1]
        self.writes.reserve(self.P + max(self.written) + self.unread)
        host = self.writes.append(tokens, lengths).to("cpu", non_blocking=True)  # pinned memory, from a CUDA device
        ready = torch.cuda.Event() if tokens.is_cuda else _Done()
        ready.record()
        return _Written(host, ready, tokens.shape[1], bool(self.stopping.suffix))

    def read(self, written: _Written) -> list[int]:
        """Emits a round `write` started, token by token through the stopping rules, once its copy has arrived
        (the loop's one wait for the GPU); returns how many tokens each row accepted (0 for rows already done)."""
        written.ready.synchronize()
        host, L = written.host.tolist(), written.width
        self.unread -= L
        counted = []
        for b, row in enumerate(host):
            self.written[b] += row[0]
            limit = self.limit()
            if self.frozen[b] or self.n_gen[b] >= limit:
                counted.append(0)
                continue
            counted.append(row[0])
            tokens = row[1 : 1 + min(row[0], limit - self.n_gen[b])]  # a row takes no tokens past the limit
            if self.finished_at[b] is None:
                suffix = row[1 + L : 1 + L + len(tokens)] if written.suffix else None
                stop = self.stopping.first_stop(
                    tokens, self.P + self.n_gen[b], suffix, lambda n, b=b: self.seq[b : b + 1, :n]
                )
                if stop is not None:
                    self.finished_at[b] = self.n_gen[b] + stop + 1
                    self.frozen[b] = self.stopping.pads_finished
                    # Padded from there on; or, once every row has finished, the limit falls to the last to finish.
                    kept = stop + 1 if self.frozen[b] else self.limit() - self.n_gen[b]
                    tokens = tokens[:kept]
            self.tokens[b].extend(tokens)
            self.n_gen[b] += len(tokens)
        return counted

    def output_length(self) -> int:
        return min(self.limit(), max(self.n_gen))

    def sequences(self, T_out: int) -> torch.LongTensor:
        """`[B, P + T_out]`: the prompt, each row's tokens, and padding after a row that finished with EOS."""
        out = self.seq[:, : self.P + T_out].clone()
        for b in range(self.B):
            if self.n_gen[b] < T_out:
                out[b, self.P + self.n_gen[b] :] = self.pad
        return out


def _prompt_columns(mask: torch.Tensor) -> list[slice | torch.Tensor]:
    """Where each row's prompt tokens sit in `seq` (`mask`: `[B, P]` bool, True at them): after the row's left
    padding (a slice), or, with padding after its first token, the mask's columns (`[n]`). One host read."""
    B, P = mask.shape
    pad, left = torch.stack([P - mask.sum(-1), (mask[:, 1:] >= mask[:, :-1]).all(-1).long()]).tolist()
    return [slice(p, None) if l else mask[b].nonzero().flatten() for b, (p, l) in enumerate(zip(pad, left))]


def _sequences(seq: torch.Tensor, prompt_columns: list, P: int, n_gen: list[int]) -> list[torch.Tensor]:
    """Each row's committed ids for the drafter (`DraftContext.sequences`) from `seq` (`[B, width]`): its prompt
    tokens (`prompt_columns`) and the `n_gen` it generated, from one copy of the columns in use, so that a drafter
    writing into them changes nothing of the output."""
    block = seq[:, : P + max(n_gen)].clone()
    return [
        block[b, columns.start : P + n]
        if isinstance(columns, slice)
        else torch.cat([block[b, columns], block[b, P : P + n]])
        for b, (columns, n) in enumerate(zip(prompt_columns, n_gen))
    ]


def _upload(flags: list[bool], device: torch.device) -> torch.Tensor:
    """`[B]` bool on `device`, without waiting for the GPU: a copy from pageable memory would wait for every launch
    queued before it (a whole round in flight, each time a row finishes). The pinned block is not reused before its
    copy has run (torch's caching host allocator records the copy)."""
    host = torch.tensor(flags, device="cpu")  # not the default device, which may be CUDA
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class _Writes:
    """The device side of `_Rows.write`: every row's sequence as plain decoding's `input_ids` holds it (`seq`, `[B,
    width]`: left padding, prompt, generated tokens, and a spare last column that takes the writes of padding
    entries), the rows' counts (`generated`, `[B]`, advanced in place) and the writes of each round's tokens
    (`_append`), replayed with `graphed` from a CUDA graph per width.

    With graphs, `for_call` keeps one for the model's next calls of the same batch size, padding id and stop-string
    criteria (`_same_criteria`): its graphs are captured once, where a call's own took an eager write and a capture
    of about 35 launches each (with stop strings) in every call. The prompt's width is an input on the device
    (`start`), so that calls of other lengths replay the same graphs.
    """

    def __init__(self, B: int, width: int, pad: int, stopping: _Stopping, device: torch.device, graphed: bool):
        self.pad = pad
        self.suffix, self.window = tuple(stopping.suffix), stopping.window if stopping.suffix else 0
        self.tables = tuple(_StopTables.of(c) for c in self.suffix)  # taken before the criteria's first call
        self.seq = torch.full((B, width), pad, dtype=torch.long, device=device)
        # Tokens written per row. It runs ahead of `_Rows.n_gen` by the rounds the host has not read, and past it in a
        # row that stopped inside a round's path (the row is done then).
        self.generated = torch.zeros(B, dtype=torch.long, device=device)
        self.start = torch.zeros((), dtype=torch.long, device=device)  # the call's prompt width P
        self.graphed = graphed
        self._bind()

    def _bind(self) -> None:
        """`append`: `_append` on `seq` (replayed from graphs with `graphed`, which hold its address)."""
        append = functools.partial(_append, self.seq, self.generated, self.start, self.suffix, self.window, self.pad)
        self.append = ShapeGraphs(append) if self.graphed else append

    def reserve(self, width: int) -> None:
        """Makes `seq` hold `width` columns before its spare one: a copy into one twice as wide (in steps of
        `CAPACITY_STEP` with graphs, captured again), so that a call's sequences grow with its tokens, not with
        `max_new_tokens`. Queued on the device after the writes before it."""
        if width < self.seq.shape[1]:
            return
        B, old = self.seq.shape
        new = max(width + 1, 2 * old)
        new = -(-new // CAPACITY_STEP) * CAPACITY_STEP if self.graphed else new
        seq = torch.full((B, new), self.pad, dtype=torch.long, device=self.seq.device)
        seq[:, :old] = self.seq
        self.seq = seq
        self._bind()

    @classmethod
    def for_call(
        cls, model, input_ids: torch.Tensor, width: int, pad: int, stopping: _Stopping, graphed: bool
    ) -> _Writes:
        """Writes for a call of prompts `input_ids` (`[B, P]`) whose sequences need `width` columns: the model's
        kept ones where they fit (with `graphed`), else new ones; set to the prompts, nothing generated."""
        B, P = input_ids.shape
        writes = _WRITES.get(model, {}).get(B) if graphed else None
        if writes is None or not writes._serves(width, pad, stopping, input_ids.device):
            # Kept widths go up in steps, as the caches' capacities do, so that calls of similar lengths share one.
            width = -(-width // CAPACITY_STEP) * CAPACITY_STEP if graphed else width
            writes = cls(B, width, pad, stopping, input_ids.device, graphed)
            if graphed:
                _WRITES.setdefault(model, {})[B] = writes
        else:
            writes.seq[:, P:] = pad
            writes.generated.zero_()
        writes.seq[:, :P] = input_ids
        writes.start.fill_(P)
        return writes

    def _serves(self, width: int, pad: int, stopping: _Stopping, device: torch.device) -> bool:
        window = stopping.window if stopping.suffix else 0
        return (self.seq.shape[1] >= width and self.pad == pad and self._same_criteria(stopping.suffix)
                and self.window == window and self.seq.device == device)  # fmt: skip

    def _same_criteria(self, suffix: list) -> bool:
        """Whether the stop-string criteria `suffix` answer as the kept ones do: a graph replays the kernels of
        those it captured, on their tensors, and never calls `suffix`'s. The same objects, or `StopStringCriteria` of
        equal tables: `generate(stop_strings=...)` builds new criteria every call."""
        return len(self.suffix) == len(suffix) and all(
            kept is new or tables.match(new) for kept, tables, new in zip(self.suffix, self.tables, suffix)
        )


@dataclass(frozen=True, eq=False)
class _StopTables:
    """What a `StopStringCriteria` computes with, taken before its first call moves the tensors to the device.
    transformers makes the tables once per vocabulary and stop strings and hands each criterion built from them the
    same tensors (5.24: keyed by the sorted vocabulary), so `match` mostly compares identities; where the key missed
    (5.17 keys by the tokenizer's vocabulary order, which a fast tokenizer changes between instances) it compares
    contents on the host, about 0.7 ms for a 248k vocabulary (a capture of the writes costs more)."""

    embedding_vec: torch.Tensor | None  # [vocab + 2, positions]; None for criteria of other types (never matched)
    scalars: tuple

    @classmethod
    def of(cls, criterion) -> _StopTables:
        if type(criterion) is not StopStringCriteria:
            return cls(None, ())
        return cls(criterion.embedding_vec, cls._scalars(criterion))

    @staticmethod
    def _scalars(c: StopStringCriteria) -> tuple:
        return (c.maximum_token_len, c.num_stop_strings, c.max_valid_positions, c.max_valid_end_lens,
                tuple(c.target_lens.tolist()))  # fmt: skip

    def match(self, criterion) -> bool:
        if self.embedding_vec is None or type(criterion) is not StopStringCriteria:
            return False
        if self._scalars(criterion) != self.scalars:
            return False
        kept, new = self.embedding_vec, criterion.embedding_vec
        same_layout = (new.device, new.shape, new.dtype) == (kept.device, kept.shape, kept.dtype)
        return new is kept or (same_layout and torch.equal(new, kept))


# model -> {batch size: `_Writes`}: the latest graphed call's writes per batch size, for the next calls.
_WRITES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _append(
    seq: torch.Tensor, generated: torch.Tensor, start: torch.Tensor, suffix: tuple, window: int, pad: int,
    tokens: torch.Tensor, lengths: torch.Tensor,
) -> torch.Tensor:
    """`_Rows.write`'s device work: writes `tokens[b, :lengths[b]]` (`[B, L]`, `[B]`) into `seq` after the row's
    `generated` tokens, which follow `start` (`[]`) columns of prompt, and advances `generated` in place; returns
    `[B, 1 + L (+ L)]`: the lengths, the tokens and, with stop strings, whether each token ends one. No host reads (a
    CUDA graph replays it)."""
    L = tokens.shape[1]
    steps = _cached_arange(L, tokens.device)  # [L]
    # Write first: stopping criteria read the row's ids. Entries past a row's length go to the spare last column as
    # padding: a finished row's count may run past the sequence by the rounds in flight, and the stop strings'
    # windows over its entries then read that column (their criterion embeds every id: no -1 there). Entries past a
    # stop are overwritten or padded later.
    real = steps < lengths[:, None]  # [B, L]
    columns = (generated + start)[:, None] + steps  # [B, L] where each token goes
    seq.scatter_(1, torch.where(real, columns, seq.shape[1] - 1), torch.where(real, tokens, pad))
    stops = _suffix_stops(suffix, window, seq, columns + 1) if suffix else None  # [B, L]
    generated.add_(lengths)
    return torch.cat([lengths[:, None], tokens] + ([stops.long()] if stops is not None else []), dim=1)


def _suffix_stops(suffix: tuple, window: int, seq: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """`[B, L]` bool on the device: whether one of the stop-string criteria `suffix` (windows of `window` tokens)
    ends row b's sequence `seq[b, :ends[b, j]]` (`ends`: `[B, L]`, at least `window`). Ends past the sequence give
    meaningless entries."""
    B, L = ends.shape
    # A round's host time is mostly launches like these: one add for the
    # columns, one criterion call per criterion (a single one holds every stop string of a request).
    offsets = _cached_arange(window, seq.device, -window)  # [W]
    columns = (ends[..., None] + offsets).clamp_(max=seq.shape[1] - 1)  # [B, L, W], ends >= window
    windows = seq.gather(1, columns.view(B, -1)).view(B * L, window)
    stops = functools.reduce(torch.logical_or, (criterion(windows, None) for criterion in suffix))
    return stops.view(B, L)


@functools.lru_cache(maxsize=64)  # keyed by prompt lengths too: bounded
def _cached_arange(n: int, device: torch.device, start: int = 0) -> torch.Tensor:
    """`[n]`: `start, ..., start + n - 1` on `device`, made once per call's arguments (read-only: index arithmetic
    of every round, one launch fewer each)."""
    return torch.arange(start, start + n, device=device)


@dataclass
class _Written:
    host: torch.Tensor  # [B, 1 + L (+ L)] on the host: lengths, tokens (and stop-string hits), arriving
    ready: object  # an event recorded after the copy
    width: int  # L
    suffix: bool  # whether stop-string hits follow the tokens


class _Done:
    """The event of a copy that has completed (off CUDA, copies are synchronous)."""

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _Streamer:
    """Hands tokens to a streamer exactly as plain decoding does: one `[B]` tensor per step, a step once every
    row has produced its token there (a padded row contributes its pad)."""

    def __init__(self, streamer, rows: _Rows):
        self.streamer, self.rows = streamer, rows
        self.sent = 0

    def flush(self, upto: int | None = None, final: bool = False) -> None:
        rows = self.rows
        if upto is None:
            upto = min(rows.max_new if rows.frozen[b] else rows.n_gen[b] for b in range(rows.B))
            upto = min(upto, rows.limit())
        if self.streamer is not None:
            for t in range(self.sent, upto):
                step = [rows.tokens[b][t] if t < rows.n_gen[b] else rows.pad for b in range(rows.B)]
                self.streamer.put(torch.tensor(step))
        self.sent = max(self.sent, upto)
        if final and self.streamer is not None:
            self.streamer.end()
