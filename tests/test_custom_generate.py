"""The Hub form: transformers loads hf_bole's `custom_generate/` from a local repository, the clone itself or the one
`custom_generate/export.py` writes, and decodes exactly as plain greedy `generate`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.models import tiny

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "custom_generate"))

import export  # noqa: E402



@pytest.fixture(scope="module")
def model():
    return tiny.build_model("dense")


def _check(model, repository: Path) -> None:
    ids = torch.tensor([[5, 17, 33, 2, 9], [71, 3, 28, 44, 60]])
    common = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    plain = model.generate(ids, **common)
    out = model.generate(
        ids, custom_generate=str(repository), trust_remote_code=True, bole_drafter="ngram",
        return_dict_in_generate=True, **common,
    )  # fmt: skip
    assert torch.equal(out.sequences, plain) and out.mean_accepted_tokens >= 1  # hf_bole's output type


def test_clone_is_a_custom_generate_repository(model):
    _check(model, REPO)


def test_export_writes_a_hub_repository(model, tmp_path):
    out = export.export(tmp_path / "hub", repo_id="someone/hf_bole")
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == [
        "README.md", "custom_generate/generate.py", "custom_generate/requirements.txt",
    ]  # fmt: skip
    readme = (out / "README.md").read_text()
    assert readme.startswith("---\n") and "  - custom_generate\n" in readme.split("---")[1]  # the model card's tag
    for section in ("Description", "Base model", "Model compatibility", "Additional Arguments", "Output Type changes",
                    "Example usage"):  # fmt: skip
        assert f"\n## {section}\n" in readme
    assert 'custom_generate="someone/hf_bole"' in readme and "github.com" not in readme
    _check(model, out)
