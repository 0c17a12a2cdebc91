"""`hf_bole.warmup`: one tree round per width that compiles its own kernels, on a scratch cache."""

from __future__ import annotations

import pytest
import torch

import hf_bole
from hf_bole.generation.warmup import WIDTHS, _binary_path
from hf_bole.kernels.utils import MAX_TREE_NODES
from tests.models import tiny


def test_widths_cover_every_specialisation():
    """Per power-of-two tile up to MAX_TREE_NODES: a width that is a multiple of 16 and one that is not; and width 1."""
    assert WIDTHS[0] == 1 and max(WIDTHS) == MAX_TREE_NODES
    tiles = {max(16, 1 << (w - 1).bit_length()) for w in range(1, MAX_TREE_NODES + 1)}
    for tile in tiles:
        inside = [w for w in WIDTHS if max(16, 1 << (w - 1).bit_length()) == tile and w > 1]
        assert any(w % 16 == 0 for w in inside) and any(w % 16 for w in inside), (tile, inside)


@pytest.mark.parametrize("width", [1, 2, 5, 16, 17, 65, 128])
def test_binary_path_follows_parents(width):
    path = _binary_path(width)
    assert path[0] == 0 and path[-1] == width - 1
    assert all((child - 1) // 2 == parent for parent, child in zip(path, path[1:]))


@pytest.mark.parametrize("verify", ["closed_form", "serial"])
def test_warmup_runs_every_width_and_leaves_generate_unchanged(verify):
    model = tiny.build_model()
    ids, mask = tiny.left_pad([[5, 17, 33, 2, 41, 9, 60], [71, 3, 28, 44]])
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=10)
    expected = model.generate(ids, **kwargs)
    # commit() checks every path against its tree: a wrong path of the warm-up would raise here
    assert hf_bole.warmup(model, batch_size=2, max_nodes=40, verify=verify) == [1, 2, 16, 17, 32, 33, 40]
    out = model.generate(ids, custom_generate="hf_bole", bole_drafter="ngram", bole_verify=verify, **kwargs)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_compiled_warmup_skips_width_one(monkeypatch):
    """With `compile`, the warm-up compiles the forward rounds reach (width >= 2), not width 1's graph of its own."""
    import hf_bole.models.adapter as adapter

    compiled = []
    monkeypatch.setattr(adapter, "_compiled", lambda decoder: compiled.append(decoder) or decoder.forward)
    model = tiny.build_model()
    assert hf_bole.warmup(model, batch_size=2, max_nodes=20, compile=True) == [2, 16, 17, 20]
    assert len(compiled) == 4


def test_warmup_rejects_bad_arguments():
    model = tiny.build_model()
    with pytest.raises(ValueError, match="batch_size must be positive"):
        hf_bole.warmup(model, batch_size=0)
    with pytest.raises(ValueError, match=f"max_nodes must be in \\[1, {MAX_TREE_NODES}\\]"):
        hf_bole.warmup(model, batch_size=1, max_nodes=MAX_TREE_NODES + 1)
