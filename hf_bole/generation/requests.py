"""What a `generate` call may ask for: refusals of settings hf_bole cannot honour, each with what to do instead."""

from __future__ import annotations

import dataclasses

from transformers import GenerationConfig
from transformers.generation.configuration_utils import GenerationMode
from transformers.utils import logging

from hf_bole.config import BoleConfig
from hf_bole.models import check_supported_model, family_of
from hf_bole.placement import Placement
from hf_bole.tensor_parallel import TensorParallel

logger = logging.get_logger(__name__)


ASSISTANT_ERROR = (
    "hf_bole drafts with its own drafter: drop {name} and choose one with bole_drafter ('mtp', the checkpoint's "
    "MTP head; 'ngram', prompt lookup; a small causal LM sharing the tokenizer, also as assistant_model=; or an "
    "object with propose(ctx) -> DraftTree)"
)
# GenerationConfig settings that ask transformers for its own assisted decoding (some only in later versions).
_ASSISTED_SETTINGS = ("prompt_lookup_num_tokens", "assistant_early_exit", "use_mtp", "speculation_type")

# Settings that turn greedy decoding into another mode of transformers' (which it runs from the Hub): not ignored
_OTHER_MODES = {
    GenerationMode.CONTRASTIVE_SEARCH: "penalty_alpha with top_k > 1 asks for contrastive search",
    GenerationMode.DOLA_GENERATION: "dola_layers asks for DoLa decoding",
}

# Output options that would need per-step tensors of plain decoding (scores of finished rows and the like).
_UNSUPPORTED_OUTPUTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")


def check_request(model, generation_config: GenerationConfig, model_kwargs: dict, dropped: dict) -> None:
    check_supported_model(model)
    if generation_config.num_beams != 1:
        raise ValueError(f"hf_bole decodes one sequence per row; num_beams={generation_config.num_beams} is not supported")
    if generation_config.num_return_sequences not in (None, 1):
        raise ValueError("hf_bole returns one sequence per row; repeat the prompts instead of num_return_sequences")
    check_assisted({}, generation_config)
    mode = generation_config.get_generation_mode()
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        raise ValueError(
            f"hf_bole decodes greedily or by sampling; {_OTHER_MODES.get(mode, f'these settings ask for {mode.value}')}"
            ": drop it"
        )
    if getattr(generation_config, "cache_implementation", None) is not None:
        logger.warning_once(
            f"hf_bole keeps the request in its own BoleCache: cache_implementation="
            f"{generation_config.cache_implementation!r} is not used"
        )
    if dropped.get("synced_gpus"):
        raise ValueError("hf_bole does not support synced_gpus (DeepSpeed ZeRO-3 / FSDP generation)")
    for flag in _UNSUPPORTED_OUTPUTS:
        if getattr(generation_config, flag, False):
            raise ValueError(f"hf_bole does not return per-step tensors: {flag}=True is not supported")
    if model_kwargs.get("inputs_embeds") is not None:
        raise ValueError("hf_bole needs input_ids (it drafts and verifies tokens); inputs_embeds is not supported")
    for key in ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw"):
        if model_kwargs.get(key) is not None:
            raise ValueError(f"hf_bole verifies text-only requests; `{key}` is not supported")


def assistant_drafter(assistant_model, kwargs: dict) -> None:
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


def check_assisted(kwargs: dict, *configs) -> None:
    """Refuses settings of `kwargs` or `configs` (GenerationConfigs, or None) that ask for transformers' assisted
    decoding without a model (prompt lookup, early exit, MTP)."""
    for name in _ASSISTED_SETTINGS:
        values = [kwargs.get(name)] + [getattr(config, name, None) for config in configs if config is not None]
        if any(value not in (None, False) for value in values):
            raise ValueError(ASSISTANT_ERROR.format(name=name))


def spread_settings(bole: BoleConfig, place: Placement) -> BoleConfig:
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


def tensor_parallel_settings(model, bole: BoleConfig, tp: TensorParallel, place: Placement) -> BoleConfig:
    """`bole` for a tensor-parallel `model` (transformers' `tp_plan`): refuses families other than Qwen3.5 and
    `compile`, and turns CUDA graphs and the drafter's compile off, saying so once. The verify forward's collectives are transformers' DTensor hooks, which
    hf_bole has not captured in graphs nor compiled (issue 60)."""
    if tp.size == 1:
        return bole
    family = family_of(model.config).name
    if family != "Qwen3.5":  # the others' plans place the heads otherwise (OLMo-Hybrid gathers its attention's)
        raise ValueError(
            f"hf_bole runs tensor parallelism (tp_plan) on Qwen3.5 models; this {family} model is sharded by one: "
            f"load it on one device or with device_map='auto'"
        )
    if bole.compile:
        raise ValueError(
            f"bole_compile=True is not supported under tensor parallelism yet (this model is split over {tp.size} "
            f"ranks by its tp_plan): drop bole_compile, or load the model on one device"
        )
    if (bole.cuda_graphs or bole.compile_drafter) and place.input_device.type == "cuda":
        logger.warning_once(
            f"hf_bole: CUDA graphs and the drafter's compile are off under tensor parallelism ({tp.size} ranks): "
            f"verify forwards and MTP drafting launch their kernels from Python (bole_cuda_graphs=False and "
            f"bole_compile_drafter=False say the same without this warning)"
        )
    return dataclasses.replace(bole, cuda_graphs=False, compile_drafter=False)
