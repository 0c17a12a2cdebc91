"""The `generate` entry point: the `custom_generate` callable, transformers' hooks, and `release`.

    model.generate(input_ids, custom_generate="hf_bole")            after `import hf_bole`
    model.generate(input_ids, custom_generate=hf_bole.generate)     the callable form
    model.generate(input_ids, custom_generate="<repo with custom_generate/>", trust_remote_code=True)

`generate` checks the request, takes the model's lock and hands the call to the decoding loop (`loop.decode`).
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
import weakref

import torch
from transformers import PreTrainedModel
from transformers.generation.utils import GenerationMixin

from hf_bole.config import BoleConfig
from hf_bole.generation.draft import drop_drafters
from hf_bole.generation.loop import decode
from hf_bole.generation.requests import assistant_drafter, check_assisted, check_cache_args
from hf_bole.generation.select import drop_select_graphs
from hf_bole.generation.verify import drop_verify_graphs
from hf_bole.generation.writes import drop_writes

CUSTOM_GENERATE_NAME = "hf_bole"
# Arguments of `GenerationMixin.generate` that transformers (5.17-5.25) does not forward to a `custom_generate`
# callable; the loop reads them from the calling frame so that a streamer still streams and an assistant model
# drafts.
_DROPPED_GENERATE_ARGS = ("streamer", "assistant_model", "synced_gpus")


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
            return decode(model, *args, **kwargs, **dropped)
    # Called with `model.generate`'s own arguments (directly, by name, or from a Hub folder): let transformers
    # prepare them and call back as the decoding method.
    kwargs.pop("custom_generate", None)
    kwargs.pop("trust_remote_code", None)
    # Settings are read again in `decode`; checking them here names a misspelt `bole_*` argument, which
    # transformers would only report as an unused model kwarg.
    assistant_drafter(kwargs.pop("assistant_model", None), kwargs)
    BoleConfig.from_generate_kwargs(kwargs, kwargs.get("generation_config"))
    # transformers would refuse these with a less helpful message, or run without them.
    check_assisted(kwargs, kwargs.get("generation_config"), model.generation_config)
    check_cache_args(kwargs)
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
                check_assisted(kwargs, passed.get("generation_config"), self.generation_config)
                check_cache_args(kwargs)
            tokenizer = kwargs.get("tokenizer")
            extracted = extract(self, custom_generate, kwargs, *args, **more)
            if custom_generate is generate:
                assistant_drafter(more.get("assistant_model", args[1] if len(args) > 1 else None), extracted)
                if tokenizer is not None:
                    extracted["tokenizer"] = tokenizer
            return extracted

        extract_generation_mode_kwargs.__hf_bole_original__ = extract
        GenerationMixin._extract_generation_mode_kwargs = extract_generation_mode_kwargs

    validate = GenerationMixin._validate_generation_mode
    if getattr(validate, "__hf_bole_original__", None) is None:

        @functools.wraps(validate)
        def validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs, *args, **more):
            # hf_bole's call with assistant_model= (its drafter now, `assistant_drafter`): not transformers' assisted
            # decoding, which 5.17-5.24 refuse for stateful models
            if isinstance(generation_mode_kwargs.get("bole_drafter"), PreTrainedModel):
                generation_mode = generation_config.get_generation_mode()
            return validate(self, generation_mode, generation_config, generation_mode_kwargs, *args, **more)

        validate_generation_mode.__hf_bole_original__ = validate
        GenerationMixin._validate_generation_mode = validate_generation_mode


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
        drop_verify_graphs(model)
        drop_select_graphs(model)
        drop_drafters(model)
        drop_writes(model)


# model -> the lock its `generate` calls hold, one call at a time: they share what hf_bole keeps for the model (the
# kept caches and graphs, the token writes, the MTP drafter with its cache).
_LOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCKS_LOCK = threading.Lock()


def _model_lock(model) -> threading.RLock:
    with _LOCKS_LOCK:
        if model not in _LOCKS:
            _LOCKS[model] = threading.RLock()
        return _LOCKS[model]
