"""Every GDN and KDA family hf_bole describes (`hf_bole.models.families`) on tiny random models: tree forwards equal plain
token-by-token decoding, and `generate` equals plain `generate` (greedy) or samples its distribution."""

from __future__ import annotations

import json
import shutil
import types

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen3NextForCausalLM

from hf_bole.cache import BoleCache
from hf_bole.generation.drafters.mtp import MTPDrafter
from hf_bole.models import adapter, all_families, check_supported_model, family_of, tree_forward
from hf_bole.models.mtp import Qwen3_5MTP, load_mtp_state_dict, save_pretrained_with_mtp
from tests.generation import sampling
from tests.generation.test_loop import oracle_for
from tests.models import tiny, tiny_families
from tests.models.test_qwen3_5 import PROMPTS, check_tree_logits, make_trees

pytestmark = pytest.mark.usefixtures("torch_gdn")

NEW = 10


@pytest.mark.parametrize("name", tiny_families.params())
@pytest.mark.parametrize(
    "shape, attn, attention, verify",
    [
        pytest.param("ragged", "sdpa", "model", "closed_form", id="ragged"),
        pytest.param("deep", "eager", "model", "closed_form", id="deep-eager"),
        pytest.param("deep", "sdpa", "model", "serial", id="deep-serial"),
        pytest.param("root", "sdpa", "model", "closed_form", id="root"),
        pytest.param("deep", "sdpa", "triton", "closed_form", id="deep-tree-attention-torch"),
    ],
)
def test_tree_forward(name, shape, attn, attention, verify):
    """Two rounds after three left-padded prompts, the second from rows of different committed lengths: every node's
    logits are those of decoding its path token by token (Lara-Mini's window of 6 slots is shorter than the prompts
    and paths; one-node trees are one-token decodes, which Kimi-Linear's KDA layer would run through its in-place conv
    update)."""
    if attention == "triton" and not tiny_families.family(name).tree_attention_kernel:
        pytest.skip("the family's attention layers run the model's own attention (test_tree_attention_kernel_refused)")
    gen = torch.Generator(torch.get_default_device()).manual_seed(1)
    model = tiny_families.build(name, attn)
    cache = BoleCache(model.config, batch_size=3)
    roots = tiny.prefill(model, cache, PROMPTS)
    committed = [list(p) for p in PROMPTS]
    for _ in range(2):
        trees = make_trees(shape, gen)
        tokens, out = check_tree_logits(model, cache, committed, roots, trees, gen, verify, attention)
        paths = [tiny.random_path(tree, gen) for tree in trees]
        cache.commit(out.tree_round, tiny.batch_trees(paths))
        for b, path in enumerate(paths):
            committed[b] += tokens[b, path].tolist()
        roots = out.logits[torch.arange(3), [p[-1] for p in paths]].argmax(-1)


@pytest.mark.parametrize(
    "name", tiny_families.params(["kimi_linear", "bailing_hybrid-moe", "qwen4_exp", "glm5_next"])
)
def test_tree_attention_kernel_refused(name):
    """Kimi-Linear's and Bailing-Hybrid's MLA layers expand their cached latents to query-key and value heads of
    different sizes, and Qwen4-Exp's QSA indexer and GLM-5-Next's DSA indexer narrow each query's mask, neither of
    which hf_bole's tree attention kernel takes: asked for by name it is refused, and "auto" runs the model's own
    attention on every device."""
    from hf_bole.config import resolve_attention

    model = tiny_families.build(name)
    cache = BoleCache(model.config, batch_size=3)
    roots = tiny.prefill(model, cache, PROMPTS)
    with pytest.raises(ValueError, match="attention='triton'.*cannot use.*MLA layers"):
        tree_forward(model, cache, roots[:, None], torch.full((3, 1), -1), attention="triton")
    ids, mask = tiny.left_pad(PROMPTS)
    with pytest.raises(ValueError, match="attention='triton'.*cannot use"):
        model.generate(ids, attention_mask=mask, pad_token_id=0, max_new_tokens=3, custom_generate="hf_bole",
                       bole_drafter="ngram", bole_attention="triton")  # fmt: skip
    kernel = tiny_families.family(name).tree_attention_kernel
    assert resolve_attention("auto", torch.device("cuda"), kernel) == "model"


@pytest.mark.parametrize("name", tiny_families.params())
@pytest.mark.parametrize("drafter", ["oracle", "ngram"])
def test_greedy_matches_plain(name, drafter):
    """Three left-padded prompts, greedy: token for token plain `generate`'s output, with deep accepted paths (the
    oracle's) and with the n-gram drafter's."""
    model = tiny_families.build(name)
    prompts = PROMPTS
    ids, mask = tiny.left_pad(prompts)
    ref = model.generate(ids, attention_mask=mask, pad_token_id=0, max_new_tokens=NEW, do_sample=False)
    bole_drafter = oracle_for(model, prompts, new=NEW) if drafter == "oracle" else "ngram"
    out = model.generate(
        ids, attention_mask=mask, pad_token_id=0, max_new_tokens=NEW, do_sample=False, custom_generate="hf_bole",
        bole_drafter=bole_drafter, bole_budget=64, return_dict_in_generate=True,
    )  # fmt: skip
    assert torch.equal(out.sequences, ref)
    if drafter == "oracle":
        assert out.mean_accepted_tokens > 3.0


@pytest.mark.interpreter
@pytest.mark.parametrize("name", tiny_families.params(["olmo_hybrid", "glm5_next"]))
def test_greedy_matches_plain_through_the_kernels(name):
    """hf_bole's Triton kernels (here under the interpreter, as on a GPU) at sizes their power-of-two tiles must mask:
    OLMo-Hybrid's GDN heads of 24 and 48 channels (the released checkpoints' are 96 and 192), and GLM-5-Next's
    compressed KV cache without a rotary key, whose empty values the KV commit moves."""
    model = tiny_families.build(name)
    prompts = PROMPTS[:2]
    ids, mask = tiny.left_pad(prompts)
    ref = model.generate(ids, attention_mask=mask, pad_token_id=0, max_new_tokens=6, do_sample=False)
    out = model.generate(
        ids, attention_mask=mask, pad_token_id=0, max_new_tokens=6, do_sample=False, custom_generate="hf_bole",
        bole_drafter=oracle_for(model, prompts, new=6), bole_budget=16, bole_cuda_graphs=False,
        return_dict_in_generate=True,
    )  # fmt: skip
    assert torch.equal(out.sequences, ref)
    assert out.mean_accepted_tokens > 2.0


@pytest.mark.parametrize(
    "name",
    tiny_families.params(
        ["qwen3_next-moe", "olmo_hybrid", "lara_mini", "kimi_linear", "bailing_hybrid-moe", "qwen4_exp", "glm5_next"]
    ),
)
def test_sampling_keeps_the_distribution(name):
    """Chi-square: the joint law of the first three sampled tokens equals plain sampling's (4000 samples each), with
    a wide tree of random drafts every round."""
    from tests.generation.test_loop import RandomDrafter

    torch.manual_seed(0)
    model = tiny_families.build(name, vocab_size=6)
    p_value = sampling.sampling_p_value(model, bole_drafter=RandomDrafter(6))
    assert p_value > 1e-3, f"sampling {name} differs from plain sampling (p = {p_value:.2e})"


def _with_mtp(name: str, folder, **save):
    """A tiny model saved with a random MTP head and loaded back the way a real checkpoint is (transformers drops the
    `mtp.*` tensors)."""
    model = tiny_families.build(name)
    mtp = Qwen3_5MTP.for_model(model)
    save_pretrained_with_mtp(model, mtp, folder, **save)
    loaded = type(model).from_pretrained(folder, attn_implementation="sdpa").eval()
    assert not any(key.startswith("mtp.") for key in loaded.state_dict())
    return loaded, mtp


@pytest.mark.parametrize(
    "name, shards",
    [
        pytest.param("qwen3_next-moe", None, id="moe"),
        pytest.param("qwen3_next-moe", "40KB", id="moe-sharded"),
        pytest.param("qwen3_next-dense", None, id="dense"),
    ],
)
def test_greedy_matches_plain_mtp(tmp_path, name, shards):
    """Qwen3-Next drafts with the MTP head of its checkpoint (single file, or sharded with an index), read from the
    safetensors files transformers skipped."""
    model, mtp = _with_mtp(name, tmp_path, **({"max_shard_size": shards} if shards else {}))
    assert (tmp_path / "model.safetensors.index.json").exists() == (shards is not None)
    loaded = MTPDrafter.from_model(model, depth=2, topk=2).mtp.state_dict()
    for key, tensor in mtp.state_dict().items():
        assert torch.equal(loaded[key], tensor), key
    ids, mask = tiny.left_pad(PROMPTS)
    ref = model.generate(ids, attention_mask=mask, pad_token_id=0, max_new_tokens=NEW, do_sample=False)
    out = model.generate(
        ids, attention_mask=mask, pad_token_id=0, max_new_tokens=NEW, do_sample=False, custom_generate="hf_bole",
        bole_depth=3, bole_topk=2,
    )  # fmt: skip
    assert torch.equal(out, ref)


def test_mtp_weights_from_the_hub_cache_only(tmp_path, monkeypatch):
    """A repo id resolves through the local Hub cache (snapshot of `refs/main`), never a download: a repo that is not
    there gets the error of a checkpoint without MTP weights."""
    import huggingface_hub.constants

    source = tmp_path / "source"
    _, mtp = _with_mtp("qwen3_next-moe", source, max_shard_size="40KB")
    cache = tmp_path / "hub"
    repo = cache / "models--org--tiny-next"
    shutil.copytree(source, repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    tensors = load_mtp_state_dict("org/tiny-next")
    assert tensors.keys() == {"mtp." + key for key in mtp.state_dict()}
    with pytest.raises(ValueError, match="Found no safetensors checkpoint.*local Hub cache"):
        load_mtp_state_dict("org/absent")
    shard = json.loads((source / "model.safetensors.index.json").read_text())["weight_map"]["mtp.fc.weight"]
    (repo / "snapshots" / "abc123" / shard).unlink()
    with pytest.raises(ValueError, match=f"puts `mtp.*` weights in.*{shard}.*downloads nothing"):
        load_mtp_state_dict("org/tiny-next")


@pytest.mark.parametrize(
    "name",
    tiny_families.params(["olmo_hybrid", "lara_mini", "kimi_linear", "bailing_hybrid-moe", "qwen4_exp", "glm5_next"]),
)
def test_families_without_an_mtp_head(name, tmp_path):
    """The default drafter needs an MTP head: families whose checkpoints have none (or one hf_bole does not read:
    Qwen4-Exp's) say which drafters they take."""
    model = tiny_families.build(name)
    ids, mask = tiny.left_pad(PROMPTS[:1])
    with pytest.raises(ValueError, match="defined for the families whose checkpoints ship one.*assistant_model="):
        model.generate(ids, attention_mask=mask, pad_token_id=0, max_new_tokens=3, custom_generate="hf_bole")


def test_unsupported_models_are_named_with_what_is_supported():
    """Another architecture (a transformer; Falcon-H1, a Mamba-2 hybrid) or a family's layout without GDN layers gets
    a ValueError that lists the supported families and classes."""
    llama = LlamaForCausalLM(
        LlamaConfig(vocab_size=tiny.VOCAB, hidden_size=32, num_hidden_layers=1, intermediate_size=32)
    )
    with pytest.raises(ValueError, match=r"Qwen3-Next \(Qwen3NextForCausalLM\).*OLMo-Hybrid.*model type 'llama'"):
        check_supported_model(llama)
    with pytest.raises(ValueError, match="Qwen3.5.*Qwen4-Exp.*model type 'falcon_h1'"):
        family_of(type("Config", (), {"get_text_config": lambda self, decoder: self, "model_type": "falcon_h1"})())
    all_attention = Qwen3NextForCausalLM(tiny_families.build("qwen3_next-dense").config.__class__(
        **{**tiny.TEXT, "intermediate_size": 64, "num_experts": 0, "layer_types": ["full_attention"] * 4}
    ))  # fmt: skip
    with pytest.raises(ValueError, match="at least one of each"):
        check_supported_model(all_attention)
    assert {f.name for f in all_families()} >= {"Qwen3.5", "Qwen3-Next", "OLMo-Hybrid", "Lara-Mini", "Qwen4-Exp"}


@pytest.mark.parametrize("name", tiny_families.params(["qwen4_exp"]))
def test_qwen4_exp_per_layer_embedding_windows(name):
    """Qwen4-Exp's per-layer embeddings keep two windows more in their GDN layers (conv states 1 and 2: the dilated
    conv's last inputs, and the n-gram hash's last tokens, eos before the first): after the same left-padded prefill
    a BoleCache holds what a DynamicCache holds, and it refuses those states for a layer without a per-layer
    embedding. (Tree forwards through them: test_tree_forward and the other family-parametrised tests.)"""
    model = tiny_families.build(name)
    eos = model.config.eos_token_id
    ids, mask = tiny.left_pad(PROMPTS)
    cache, dynamic = BoleCache(model.config, batch_size=3), DynamicCache(config=model.config)
    assert torch.equal(cache.get_conv_state(0, state_idx=2), torch.full((3, 2), eos))
    for c in (cache, dynamic):
        model(ids, attention_mask=mask, past_key_values=c)
    for layer in (0, 2):  # ple_layer_ids [1, 3], one-indexed
        for state_idx in (1, 2):
            torch.testing.assert_close(
                cache.get_conv_state(layer, state_idx=state_idx), dynamic.layers[layer].conv_states[state_idx]
            )
    assert cache.get_conv_state(2, state_idx=2)[2].tolist() == [eos, 13]  # the third prompt is [13], left-padded
    with pytest.raises(ValueError, match=r"layer 1 asks for conv state 1.*layers \[0, 2\]"):
        cache.get_conv_state(1, state_idx=1)


@pytest.mark.parametrize("name", tiny_families.params(["qwen4_exp", "glm5_next"]))
def test_indexed_families_verify_without_cuda_graphs(name, monkeypatch):
    """Qwen4-Exp's indexer reads each query's visible slots back to the host (`torch.nonzero`), GLM-5-Next's the
    pools every row holds (a boolean index) and hf_bole the longest node sequence, which a CUDA graph cannot hold:
    their verify forwards never replay from graphs, where a Qwen3.5 model's on one CUDA device do."""
    from hf_bole.generation import graphs

    on_cuda = types.SimpleNamespace(spans_devices=False, input_device=torch.device("cuda"))
    monkeypatch.setattr(graphs, "placement", lambda model: on_cuda)
    # the tiny MoE models' experts route with transformers' eager implementation, which keeps graphs off by itself:
    # taken out, the family's `cuda_graphs` decides
    monkeypatch.setattr(graphs, "graph_unsafe_experts", lambda model: [])
    assert graphs.captures(tiny_families.build("qwen3_5-dense"), True)
    assert not graphs.captures(tiny_families.build(name), True)


def test_sliding_window_mask():
    """A sliding-window layer's tree mask keeps, of a node's committed slots and ancestors, those decoded within
    `window` slots of it: the row's committed slots after `lengths + depth - window`, an ancestor by its depth (not
    its slot)."""
    parents = [-1, 0, 0, 2]  # depths 0, 1, 1, 2 at slots 3, 4, 5, 6 after 3 committed slots
    mask = torch.zeros(1, 1, 4, 8, dtype=torch.bool)
    mask[..., :3] = True
    for i in range(4):
        for j in tiny.path_to(parents, i):
            mask[0, 0, i, 3 + j] = True
    cache = type("Cache", (), {"lengths": torch.tensor([3]), "positions": torch.tensor([10])})()
    windowed = adapter._sliding(mask, cache, torch.tensor([[10, 11, 11, 12]]), window=2)
    expected = torch.tensor(
        [
            [0, 0, 1, 1, 0, 0, 0, 0],  # decoded at slot 3: committed slot 2 and itself
            [0, 0, 0, 1, 1, 0, 0, 0],  # at slot 4: the root and itself
            [0, 0, 0, 1, 0, 1, 0, 0],
            [0, 0, 0, 0, 0, 1, 1, 0],  # at slot 5: its parent (decoded at 4) and itself, not the root (at 3)
        ],
        dtype=torch.bool,
    )
    assert torch.equal(windowed[0, 0], expected)
