"""BoleConfig: validated defaults, and gathering `bole_*` settings from generate kwargs and GenerationConfig."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from hf_bole.config import BoleConfig, resolve_attention
from hf_bole.generation import NgramDrafter


class _Drafter:
    def propose(self, ctx):
        raise NotImplementedError


def test_defaults_are_valid():
    config = BoleConfig()
    settings = (config.depth, config.topk, config.budget, config.epsilon, config.verify, config.attention)
    assert settings == (5, 4, "auto", 0.3, "closed_form", "auto") and config.drafter == "mtp"


def test_auto_attention_is_the_kernel_on_cuda():
    """ "auto" attention: hf_bole's tree attention kernel where the cache is on CUDA, the model's own elsewhere (the
    kernel's stand-in off CUDA is a torch reference); a named one is kept."""
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert (resolve_attention("auto", cuda), resolve_attention("auto", cpu)) == ("triton", "model")
    assert [resolve_attention(a, d) for a in ("model", "triton") for d in (cuda, cpu)] == ["model"] * 2 + ["triton"] * 2
    with pytest.raises(ValueError, match="attention must be one of \\('auto', 'model', 'triton'\\), got 'sdpa'"):
        resolve_attention("sdpa", cpu)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        pytest.param({"depth": 0}, "BoleConfig.depth must be a positive int, got 0", id="depth-0"),
        pytest.param({"topk": -1}, "BoleConfig.topk", id="topk-negative"),
        pytest.param({"budget": "fast"}, r"an int >= 0 \(0: the roots alone, plain decoding\) or 'auto', got 'fast'",
                     id="budget-str"),  # fmt: skip
        pytest.param({"budget": -1}, "BoleConfig.budget must be an int >= 0", id="budget-negative"),
        pytest.param({"budget": False}, "BoleConfig.budget must be an int >= 0", id="budget-bool"),
        pytest.param({"epsilon": -0.1}, "BoleConfig.epsilon must be a finite number >= 0, got -0.1", id="epsilon-neg"),
        pytest.param({"epsilon": float("nan")}, "BoleConfig.epsilon", id="epsilon-nan"),
        pytest.param({"epsilon": "0.1"}, "BoleConfig.epsilon", id="epsilon-str"),
        pytest.param({"epsilon": True}, "BoleConfig.epsilon", id="epsilon-bool"),
        pytest.param({"depth": True}, "BoleConfig.depth", id="depth-bool"),
        pytest.param({"budget": 2.0}, "BoleConfig.budget", id="budget-float"),
        pytest.param({"verify": "fast"}, "BoleConfig.verify must be one of", id="verify"),
        pytest.param({"attention": "sdpa"}, "BoleConfig.attention must be one of", id="attention"),
        pytest.param({"prefill": "graph"}, "BoleConfig.prefill must be one of", id="prefill"),
        pytest.param({"fuse_projections": 1}, "BoleConfig.fuse_projections must be True or False", id="fuse-int"),
        pytest.param({"compile_drafter": "yes"}, "BoleConfig.compile_drafter must be True or False", id="drafter-str"),
        pytest.param({"drafter": "eagle"}, "BoleConfig.drafter must be one of", id="drafter-name"),
        pytest.param({"drafter": object()}, "object without one", id="drafter-object"),
        pytest.param({"drafter": NgramDrafter}, r"got the class NgramDrafter: pass an instance", id="drafter-class"),
        pytest.param({"prefill": "chains", "verify": "serial"}, "prefill='chains' runs the prompt", id="chains-serial"),
        pytest.param({"ngram_min_size": 3, "ngram_max_size": 2}, "ngram_min_size", id="ngram-order"),
        pytest.param({"ngram_max_size": 0}, "BoleConfig.ngram_max_size", id="ngram-0"),
    ],
)
def test_invalid_fields(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BoleConfig(**kwargs)


def test_drafter_object_accepted():
    drafter = _Drafter()
    assert BoleConfig(drafter=drafter).drafter is drafter


def test_from_generate_kwargs_precedence():
    drafter = _Drafter()
    generation_config = GenerationConfig(max_new_tokens=4, bole_depth=3, bole_topk=2)
    kwargs = {
        "bole_config": BoleConfig(budget=64, depth=9, drafter=drafter),
        "bole_topk": 6,
        "max_new_tokens": 8,
        "attention_mask": None,
    }
    config, rest = BoleConfig.from_generate_kwargs(kwargs, generation_config)
    # topk: kwarg 6 beats the GenerationConfig's 2; depth: GenerationConfig 3 beats bole_config's 9;
    # budget: bole_config's 64 beats the default; drafter: the same object, not a copy
    assert (config.topk, config.depth, config.budget) == (6, 3, 64)
    assert config.drafter is drafter
    assert rest == {"max_new_tokens": 8, "attention_mask": None}
    assert "bole_topk" in kwargs  # the caller's dict is left alone


def test_from_generate_kwargs_defaults():
    config, rest = BoleConfig.from_generate_kwargs({}, None)
    assert config == BoleConfig() and rest == {}


def test_from_generate_kwargs_validates_values():
    with pytest.raises(ValueError, match="BoleConfig.depth"):
        BoleConfig.from_generate_kwargs({"bole_depth": 0})


@pytest.mark.parametrize(
    "kwargs, generation_config, message",
    [
        pytest.param({"bole_dept": 3}, None, "Unknown hf_bole setting `bole_dept`.*Did you mean `bole_depth`",
                     id="typo"),
        pytest.param({}, GenerationConfig(bole_budjet=3), "`bole_budjet` \\(a GenerationConfig attribute\\)", id="gc"),
        pytest.param({"bole_zzz": 1}, None, "Known settings: bole_config, bole_depth", id="no-suggestion"),
        pytest.param({"bole_config": {"depth": 3}}, None, "must be a BoleConfig", id="config-type"),
        pytest.param({}, GenerationConfig(bole_config=BoleConfig()), "not a GenerationConfig attribute",
                     id="gc-config"),
    ],
)
def test_from_generate_kwargs_rejects(kwargs, generation_config, message):
    with pytest.raises(ValueError, match=message):
        BoleConfig.from_generate_kwargs(kwargs, generation_config)


def test_kwarg_names():
    names = BoleConfig.kwarg_names()
    assert names[0] == "bole_config"
    assert {"bole_depth", "bole_topk", "bole_budget", "bole_epsilon", "bole_verify", "bole_drafter"} <= set(names)


def test_budget_auto_and_epsilon():
    config, _ = BoleConfig.from_generate_kwargs({"bole_budget": 48, "bole_epsilon": 0.25})
    assert (config.budget, config.epsilon) == (48, 0.25)
    assert BoleConfig(budget="auto", epsilon=0).epsilon == 0
