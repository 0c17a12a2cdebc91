"""Test fixtures: seeds, NaN-poisoned allocations inside hf_bole, device selection."""

from __future__ import annotations

import importlib.util
import inspect
import os
import sys

import pytest
import torch

# pytest-xdist runs one worker per core: more torch threads per worker would only oversubscribe them.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

# Without a GPU, Triton kernels are built for the interpreter (this must happen before hf_bole is imported).
# Tests marked `interpreter` run them there; all other tests take the torch path on CPU tensors.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# `HF_BOLE_TEST_DEVICE=cuda python -m pytest tests/models tests/cache tests/generation` runs the model-level tests
# with every tensor and model made on the GPU (the kernel tests pick their device through the `device` fixture).
if os.environ.get("HF_BOLE_TEST_DEVICE"):
    torch.set_default_device(os.environ["HF_BOLE_TEST_DEVICE"])

_empty, _empty_like = torch.empty, torch.empty_like
# torch's device context (`with torch.device("meta")`) records which functions construct tensors at its first use:
# used once here, it records torch's own `empty`, not the wrappers below (which it would then not place).
with torch.device("meta"):
    torch.empty(0)


def _poison(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point():
        t.fill_(float("nan"))
    elif t.dtype != torch.bool:
        t.fill_(-(2**30) if t.dtype in (torch.int32, torch.int64) else 0)
    return t


def _from_hf_bole() -> bool:
    return sys._getframe(2).f_globals.get("__name__", "").startswith("hf_bole")


def _poisoned_empty(*args, **kwargs):
    t = _empty(*args, **kwargs)
    return _poison(t) if _from_hf_bole() else t


def _poisoned_empty_like(*args, **kwargs):
    t = _empty_like(*args, **kwargs)
    return _poison(t) if _from_hf_bole() else t


@pytest.fixture(autouse=True)
def poison_empty(monkeypatch):
    """Every `torch.empty`/`empty_like` made inside hf_bole starts as NaN, so unwritten outputs fail loudly."""
    monkeypatch.setattr(torch, "empty", _poisoned_empty)
    monkeypatch.setattr(torch, "empty_like", _poisoned_empty_like)


@pytest.fixture(autouse=True)
def triton_mode(request, monkeypatch):
    if torch.cuda.is_available() or request.node.get_closest_marker("interpreter") is not None:
        return
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.fixture(autouse=True)
def seed():
    torch.manual_seed(42)


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def torch_gdn(monkeypatch):
    """The GDN layers run transformers' torch reference, also where fla-core is importable (where transformers
    would run fla's kernels). Tests that compare hf_bole's kernels with transformers' own forward at fp32
    tolerances use it (fla's chunked kernel computes in tf32 on a GPU and is itself ~1e-3 off in fp32), and
    tests that run a model on the CPU of a GPU machine (fla's kernels take GPU tensors only)."""
    if importlib.util.find_spec("fla") is None:
        return
    from hf_bole.models import all_families

    for module in [f.module(t) for f in all_families() if f.available for t in f.modules]:
        for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
            # Unwrapped past hf_bole's seam and transformers' kernel dispatch; tree_forward wraps the seam around
            # it again, and the fixture's teardown puts the usual dispatch back.
            monkeypatch.setattr(module, name, inspect.unwrap(getattr(module, name)))
