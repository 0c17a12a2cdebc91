"""Input checks shared by the kernels."""

from __future__ import annotations

import contextlib

import pytest
import torch

from hf_bole.kernels import utils


def test_check_parents_reads_a_tree_once_until_it_changes(monkeypatch):
    parents = torch.tensor([[-1, 0, 1, 1]])
    reads = []
    original = torch.Tensor.any
    monkeypatch.setattr(torch.Tensor, "any", lambda self, *a, **k: reads.append(1) or original(self, *a, **k))
    for _ in range(3):  # one forward hands the same tree to every layer
        utils.check_parents(parents, 1, 4)
    assert len(reads) == 1
    parents[0, 3] = 3  # modified in place: checked again
    with pytest.raises(ValueError, match=r"parents\[0, 3\] = 3"):
        utils.check_parents(parents, 1, 4)
    assert len(reads) == 2
    key = id(parents)
    del parents
    assert key not in utils._CHECKED_PARENTS


def test_check_parents_of_inference_tensors():
    """A tree made under `torch.inference_mode()` has no version counter: checked at every call, bad ones refused."""
    with torch.inference_mode():
        parents = torch.tensor([[-1, 0, 1, 1]])
        utils.check_parents(parents, 1, 4)
        utils.check_parents(parents, 1, 4)
        parents[0, 3] = 3
        with pytest.raises(ValueError, match=r"parents\[0, 3\] = 3"):
            utils.check_parents(parents, 1, 4)


def test_on_device():
    """Triton launches on the current CUDA device: kernels on a second GPU's tensors make it current meanwhile."""
    assert isinstance(utils.on_device(torch.zeros(1, device="cpu")), contextlib.nullcontext)  # nothing to switch
    if torch.cuda.is_available():  # the current GPU: nothing to switch either
        assert isinstance(utils.on_device(torch.zeros(1, device="cuda")), contextlib.nullcontext)
    if torch.cuda.device_count() > 1:
        with utils.on_device(torch.zeros(1, device="cuda:1")):
            assert torch.cuda.current_device() == 1
        assert torch.cuda.current_device() == 0


def test_use_pdl_only_for_nvidia_hopper(monkeypatch):
    """Programmatic dependent launch is asked for only on an NVIDIA GPU of compute capability 9 or later: the
    interpreter and other backends do not know the launch option or the wait instruction."""
    x = torch.zeros(1)
    assert not utils.use_pdl(x)  # a CPU tensor (the interpreter's)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(utils, "is_interpreter", lambda: False)
    for capability, hip, expected in (((9, 0), None, True), ((8, 0), None, False), ((9, 4), "6.2", False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, c=capability: c)
        monkeypatch.setattr(torch.version, "hip", hip)
        utils._launches_dependents.cache_clear()  # asked once per device: each case is a new GPU
        assert utils.use_pdl(x) is expected, (capability, hip)
    utils._launches_dependents.cache_clear()


def test_next_power_of_2_is_tritons():
    import triton

    assert [utils.next_power_of_2(n) for n in range(300)] == [triton.next_power_of_2(n) for n in range(300)]
