"""eval/check_families.py on the CPU: a family built from its config defaults plus the check's own fields, shrunk by
`--override`, decoded by plain generate and hf_bole."""

from __future__ import annotations

import pytest
import transformers

from eval import check_families

# every field the check leaves at a size a CPU cannot hold, shrunk (the indexer, PLE and rotary fields stay the check's)
SMALL = ["hidden_size=256", "head_dim=64", "num_experts=8", "num_experts_per_tok=2", "moe_intermediate_size=64",
         "shared_expert_intermediate_size=64", "vocab_size=1000", "linear_num_key_heads=2", "linear_num_value_heads=4",
         "hc_lowrank=16"]  # fmt: skip


@pytest.mark.skipif(not hasattr(transformers, "Qwen4ExpTextConfig"), reason="Qwen4-Exp needs transformers 5.24 on")
def test_qwen4_exp_builds_with_the_checks_indexer_and_decodes_as_plain_generate(capsys):
    """Qwen4-Exp's defaults leave the indexer unset (the config refuses them): the check's fields make it build, and
    hf_bole's greedy output equals plain generate's with both drafters."""
    argv = ["--families", "Qwen4-Exp", "--layers", "8", "--new", "12", "--device", "cpu", "--dtype", "fp32"]
    assert check_families.main(argv + ["--override", *SMALL]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Qwen4-Exp")]
    assert len(lines) == 2 and all(line.endswith("identical to plain generate") for line in lines), lines
