"""MTP head loading/saving and the MTP tree drafter, against a plain sequential MTP recursion."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

from hf_bole.generation.drafters import mtp as mtp_module
from hf_bole.generation.drafters.base import DraftContext
from hf_bole.generation.drafters.mtp import MTPDrafter
from hf_bole.generation.tree import DraftTree
from hf_bole.kernels.topk import MAX_K
from hf_bole.models import mtp as head_module
from hf_bole.models.mtp import Qwen3_5MTP, mtp_attention, save_pretrained_with_mtp
from tests.generation.recorded_graph import recording_capture
from tests.kernels.trees import BACKENDS

VOCAB, HIDDEN = 61, 64

_SHAPES = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)


def _model(moe: bool) -> torch.nn.Module:
    if moe:
        config = Qwen3_5MoeTextConfig(
            **_SHAPES,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=4,
            num_experts_per_tok=2,
        )
        model = Qwen3_5MoeForCausalLM(config)
    else:
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**_SHAPES, intermediate_size=96))
    with torch.no_grad():
        # peaked draft distributions, so top-k choices are far from ties
        model.get_input_embeddings().weight.normal_()
        model.lm_head.weight.normal_(std=0.5)
    return model.eval()


def _mtp(model) -> Qwen3_5MTP:
    mtp = Qwen3_5MTP.for_model(model)
    with torch.no_grad():
        for p in mtp.parameters():
            p.normal_(std=0.2)
    return mtp.eval()


def _drafter(
    model, mtp, depth: int, topk: int, max_nodes: int | None = None, compile: bool = False, fuse: bool = False
) -> MTPDrafter:
    return MTPDrafter(
        mtp,
        model.get_input_embeddings(),
        model.get_output_embeddings(),
        model.get_decoder().rotary_emb,
        depth=depth,
        topk=topk,
        max_nodes=max_nodes,
        compile=compile,
        fuse_projections=fuse,
    )


def _rows(lengths: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per row: n committed entries' target hidden states `[n, hidden]` and the token ids `[n + 1]` (root last)."""
    return [(torch.randn(n, HIDDEN), torch.randint(VOCAB, (n + 1,))) for n in lengths]


def _ctx(rows, starts: list[int], ends: list[int], max_nodes: int = 1000, left_pad: bool = False, positions=True):
    """The context of a call bringing in entries `[start, end)` of every row (row b's root is token `end`)."""
    A = max(e - s for s, e in zip(starts, ends))
    B = len(rows)
    hidden = torch.randn(B, A, HIDDEN)  # padding entries hold garbage on purpose
    next_tokens = torch.randint(VOCAB, (B, A))
    new_mask = torch.zeros(B, A, dtype=torch.bool)
    pos = torch.zeros(B, A, dtype=torch.long)
    for b, ((h, ids), s, e) in enumerate(zip(rows, starts, ends)):
        cols = slice(A - (e - s), A) if left_pad else slice(0, e - s)
        hidden[b, cols] = h[s:e]
        next_tokens[b, cols] = ids[s + 1 : e + 1]
        new_mask[b, cols] = True
        pos[b, cols] = torch.arange(s, e)
    return DraftContext(
        sequences=[ids[: e + 1] for (_, ids), e in zip(rows, ends)],
        max_nodes=max_nodes,
        hidden_states=hidden,
        next_tokens=next_tokens,
        new_mask=new_mask,
        positions=pos if positions else None,
    )


class _Sequential:
    """The MTP recursion without cache or tree: every step reruns the head causally over all of its entries."""

    def __init__(self, model, mtp, hidden: torch.Tensor, ids: torch.Tensor):
        self.model, self.mtp = model, mtp
        self.hidden, self.ids = hidden, ids  # [n, hidden], [n + 1]
        self._outputs = {}

    @torch.no_grad()
    def output(self, path: tuple[int, ...]) -> torch.Tensor:
        """`[hidden]`: the head's output at the last entry, after the committed entries and one entry per path token
        (whose hidden input is the output at its parent)."""
        if path not in self._outputs:
            hidden = torch.cat([self.hidden, *[self.output(path[:i])[None] for i in range(len(path))]])
            tokens = torch.cat([self.ids[1:], torch.tensor(path, dtype=torch.long)])
            T = len(tokens)
            embeds = self.model.get_input_embeddings()(tokens)[None]
            rope = self.model.get_decoder().rotary_emb(embeds, torch.arange(T).expand(3, 1, T))
            causal = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
            self._outputs[path] = self.mtp(embeds, hidden[None], rope, attention_mask=causal)[0, -1]
        return self._outputs[path]

    @torch.no_grad()
    def log_probs(self, path: tuple[int, ...]) -> torch.Tensor:
        """`[V]`: log p_draft of the children of the node reached by `path` (the root's children for `()`)."""
        return self.model.lm_head(self.output(path)).log_softmax(-1)


def _paths(tree, b: int) -> list[tuple[int, ...]]:
    """The token path from the root to every node of row b."""
    paths = []
    for token, parent in zip(tree.tokens[b].tolist(), tree.parents[b].tolist()):
        paths.append((paths[parent] if parent >= 0 else ()) + (token,))
    return paths


def _assert_same_trees(tree, expected):
    """Same tokens and topology; draft log-probabilities equal up to rounding."""
    assert torch.equal(tree.tokens, expected.tokens)
    assert torch.equal(tree.parents, expected.parents)
    torch.testing.assert_close(tree.draft_logprobs, expected.draft_logprobs, rtol=1e-5, atol=1e-5)


def _row(tree, b: int):
    rows = slice(b, b + 1)
    return type(tree)(tokens=tree.tokens[rows], parents=tree.parents[rows], draft_logprobs=tree.draft_logprobs[rows])


@pytest.mark.parametrize(
    "moe, max_shard_size",
    [
        pytest.param(False, None, id="dense"),
        pytest.param(False, "40KB", id="dense-sharded"),
        pytest.param(True, None, id="moe"),
    ],
)
def test_save_pretrained_with_mtp(tmp_path, moe, max_shard_size):
    model = _model(moe)
    mtp = _mtp(model)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    save_pretrained_with_mtp(model, mtp, tmp_path, **kwargs)
    assert (tmp_path / "model.safetensors.index.json").exists() == (max_shard_size is not None)
    assert json.loads((tmp_path / "config.json").read_text())["mtp_num_hidden_layers"] == 1

    loaded = type(model).from_pretrained(tmp_path)
    drafter = MTPDrafter.from_model(loaded, depth=2, topk=2)
    expected, got = mtp.state_dict(), drafter.mtp.state_dict()
    assert expected.keys() == got.keys()
    for key in expected:
        assert torch.equal(expected[key], got[key]), key
    assert drafter.lm_head is loaded.lm_head and drafter.embed_tokens is loaded.get_input_embeddings()


def test_from_model_per_expert_layout():
    """MoE checkpoints may store the MTP layer's experts one by one; they load fused, as transformers fuses them."""
    model = _model(moe=True)
    mtp = _mtp(model)
    state_dict = {}
    for key, tensor in mtp.state_dict().items():
        if key.endswith("experts.gate_up_proj"):
            prefix = "mtp." + key.removesuffix("gate_up_proj")
            for e, w in enumerate(tensor):
                gate, up = w.chunk(2)
                state_dict[f"{prefix}{e}.gate_proj.weight"] = gate
                state_dict[f"{prefix}{e}.up_proj.weight"] = up
        elif key.endswith("experts.down_proj"):
            prefix = "mtp." + key.removesuffix("down_proj")
            state_dict.update({f"{prefix}{e}.down_proj.weight": w for e, w in enumerate(tensor)})
        else:
            state_dict["mtp." + key] = tensor
    state_dict["model.embed_tokens.weight"] = torch.zeros(1)  # not an MTP key: ignored
    loaded = MTPDrafter.from_model(model, depth=2, topk=2, state_dict=state_dict).mtp.state_dict()
    for key, tensor in mtp.state_dict().items():
        assert torch.equal(tensor, loaded[key]), key


def test_from_model_without_mtp_weights(tmp_path):
    model = _model(moe=False)
    model.save_pretrained(tmp_path)
    loaded = Qwen3_5ForCausalLM.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"no `mtp\.\*` weights.*bole_drafter=\"ngram\""):
        MTPDrafter.from_model(loaded, depth=2, topk=2)
    with pytest.raises(ValueError, match=r"no `mtp\.\*` weights"):
        MTPDrafter.from_model(loaded, depth=2, topk=2, state_dict={"model.norm.weight": torch.zeros(HIDDEN)})


@pytest.mark.parametrize(
    "moe, depth, topk",
    [
        pytest.param(False, 5, 1, id="dense-chain"),
        pytest.param(False, 4, 3, id="dense-tree"),
        pytest.param(False, 1, 4, id="dense-depth1"),
        pytest.param(True, 3, 2, id="moe-tree"),
    ],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_propose_matches_sequential(moe, depth, topk, backend):
    """Every node's draft log-prob, every node's children and every level's expanded nodes match the plain recursion
    (with the torch paths, and with hf_bole's attention and top-k kernels under the interpreter)."""
    model = _model(moe)
    mtp = _mtp(model)
    rows = _rows([7, 4])
    tree = _drafter(model, mtp, depth, topk).propose(_ctx(rows, [0, 0], [7, 4], left_pad=True))
    tree.validate(batch_size=2, vocab_size=VOCAB)
    assert tree.num_nodes == topk + (depth - 1) * topk**2
    depths, cum = tree.depths(), tree.cumulative_logprobs()
    for b, (hidden, ids) in enumerate(rows):
        ref = _Sequential(model, mtp, hidden, ids)
        paths = _paths(tree, b)
        got = tree.draft_logprobs[b]
        want = torch.stack([ref.log_probs(path[:-1])[path[-1]] for path in paths])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # an expanded node (or the root) has exactly the top-k tokens of its draft distribution as children
        expanded = [()] + sorted({path[:-1] for path in paths if len(path) > 1})
        for parent in expanded:
            children = {path[-1] for path in paths if path[:-1] == parent}
            assert children == set(ref.log_probs(parent).topk(topk).indices.tolist()), parent
        # the expanded nodes of each level are its top-k by cumulative draft probability
        for d in range(depth - 1):
            level = (depths[b] == d).nonzero().flatten()
            best = level[cum[b, level].topk(topk).indices].tolist()
            assert {paths[i] for i in best} == {p for p in expanded if len(p) == d + 1}
    if topk == 1:  # the chain is the greedy recursion
        ref = _Sequential(model, mtp, *rows[0])
        greedy = ()
        for _ in range(depth):
            greedy += (int(ref.log_probs(greedy).argmax()),)
        assert tuple(tree.tokens[0].tolist()) == greedy


def test_propose_ragged_batch_matches_single_rows():
    """Rows of different lengths, left-padded at prefill and right-padded later, draft as if each were alone."""
    model = _model(moe=False)
    mtp = _mtp(model)
    lengths, accepted = [9, 3, 6], [2, 4, 1]
    rows = _rows([n + a for n, a in zip(lengths, accepted)])
    batched = _drafter(model, mtp, depth=3, topk=3)
    singles = [_drafter(model, mtp, depth=3, topk=3) for _ in rows]
    starts, ends = [0] * 3, lengths
    for left_pad in (True, False):
        tree = batched.propose(_ctx(rows, starts, ends, left_pad=left_pad))
        for b, single in enumerate(singles):
            alone = single.propose(_ctx(rows[b : b + 1], starts[b : b + 1], ends[b : b + 1]))
            _assert_same_trees(_row(tree, b), alone)
        starts, ends = ends, [n + a for n, a in zip(lengths, accepted)]


def test_propose_extension_in_pieces():
    """Entries committed over several rounds (ragged, past the initial capacity) give the trees of one-shot prefill."""
    model = _model(moe=False)
    mtp = _mtp(model)
    rows = _rows([300, 40])
    bounds = [[0, 7, 10, 200, 290, 300], [0, 1, 2, 17, 39, 40]]  # entries [bounds[i], bounds[i + 1]) per round
    drafter = _drafter(model, mtp, depth=3, topk=2)
    for r in range(1, len(bounds[0])):
        starts, ends = [bound[r - 1] for bound in bounds], [bound[r] for bound in bounds]
        tree = drafter.propose(_ctx(rows, starts, ends, positions=False))
        one_shot = _drafter(model, mtp, depth=3, topk=2).propose(_ctx(rows, [0, 0], ends, left_pad=True))
        _assert_same_trees(tree, one_shot)
    assert drafter._cache.capacity >= 300


@pytest.mark.parametrize(
    "depth, topk, ctx_max_nodes, max_nodes",
    [
        pytest.param(4, 3, 1000, None, id="all-30"),
        pytest.param(4, 3, 11, None, id="ctx-cap-11"),
        pytest.param(5, 4, 1000, 20, id="drafter-cap-20"),
        pytest.param(3, 2, 1, None, id="cap-1"),
    ],
)
def test_propose_tree_shape(depth, topk, ctx_max_nodes, max_nodes):
    model = _model(moe=False)
    rows = _rows([5, 8, 2])
    drafter = _drafter(model, _mtp(model), depth, topk, max_nodes)
    tree = drafter.propose(_ctx(rows, [0, 0, 0], [5, 8, 2], max_nodes=ctx_max_nodes, left_pad=True))
    tree.validate(batch_size=3, vocab_size=VOCAB)  # parents earlier, sibling tokens distinct, log-probs <= 0
    assert tree.num_nodes == min(topk + (depth - 1) * topk**2, ctx_max_nodes, max_nodes or ctx_max_nodes)
    assert tree.depths().max() <= depth - 1
    cum = tree.cumulative_logprobs()
    assert (cum[:, 1:] <= cum[:, :-1]).all()  # best first: every prefix is the best tree of its size
    assert (tree.parents[:, 0] == -1).all()


@pytest.mark.parametrize("max_nodes", [1, 2, 3, 4, 7])
def test_propose_grows_no_deeper_than_its_nodes(max_nodes, monkeypatch):
    """A tree of `max_nodes` nodes grows at most `max_nodes` levels (one LM head row a request at 1: a large batch's
    chain of one), and keeps the very nodes the whole tree's best `max_nodes` are."""
    model = _model(moe=False)
    mtp = _mtp(model)
    rows = _rows([6, 9])
    ctx = lambda n: _ctx(rows, [0, 0], [6, 9], max_nodes=n, left_pad=True)  # noqa: E731
    whole = _drafter(model, mtp, depth=5, topk=3).propose(ctx(1000))
    drafter = _drafter(model, mtp, depth=5, topk=3)
    steps = []
    step = drafter._step
    monkeypatch.setattr(drafter, "_step", lambda *a, **k: steps.append(1) or step(*a, **k))
    tree = drafter.propose(ctx(max_nodes))
    expected = DraftTree(*(x[:, :max_nodes] for x in (whole.tokens, whole.parents, whole.draft_logprobs)))
    _assert_same_trees(tree, expected)
    # the prompt's extension and its last entries' (`_extend_all_but_last`), then one step a level below the first
    assert len(steps) == 2 + min(5, max_nodes) - 1


def test_propose_of_no_nodes_extends_the_cache_only(monkeypatch):
    """A round that verifies no draft (`max_nodes` 0): the drafter takes in the new entries (one MTP step) and drafts
    nothing; its later trees are those of a drafter that drafted every round."""
    model = _model(moe=False)
    mtp = _mtp(model)
    rows = _rows([30, 12])
    bounds = [[0, 7, 10, 12, 15], [0, 1, 2, 4, 7]]
    quiet, busy = _drafter(model, mtp, 3, 2), _drafter(model, mtp, 3, 2)
    steps = []
    step = quiet._step
    monkeypatch.setattr(quiet, "_step", lambda *a, **k: steps.append(1) or step(*a, **k))
    for r in range(1, len(bounds[0])):
        starts, ends = [bound[r - 1] for bound in bounds], [bound[r] for bound in bounds]
        nodes = 0 if r % 2 else 1000
        tree = quiet.propose(_ctx(rows, starts, ends, max_nodes=nodes, positions=False))
        expected = busy.propose(_ctx(rows, starts, ends, positions=False))
        if nodes:
            _assert_same_trees(tree, expected)
        else:
            assert tree.tokens.shape == tree.parents.shape == tree.draft_logprobs.shape == (2, 0)
    # extension only in rounds 1 (a prompt: two steps) and 3; extension and two levels in 2 and 4
    assert len(steps) == 2 + 3 + 1 + 3


class _FixedLogits(torch.nn.Module):
    """An lm_head that ignores its input."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.logits = logits
        self.weight = torch.zeros(len(logits), HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits.expand(*x.shape[:-1], -1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_propose_ties_and_impossible_tokens(backend):
    """Token 3 has draft probability exactly 1 and token 7 a sliver, all others 0: the chain 3 -> 3 -> 3 ties at
    cumulative log-prob 0 and must come shallower first; children of probability 0 become padding, last."""
    model = _model(moe=False)
    logits = torch.full((VOCAB,), float("-inf"))
    logits[3], logits[7] = 0.0, -1e4
    embed, rope = model.get_input_embeddings(), model.get_decoder().rotary_emb
    drafter = MTPDrafter(_mtp(model), embed, _FixedLogits(logits), rope, depth=3, topk=3)
    tree = drafter.propose(_ctx(_rows([4, 6]), [0, 0], [4, 6], left_pad=True))
    tree.validate(batch_size=2, vocab_size=VOCAB)
    assert tree.tokens[:, :3].eq(3).all() and tree.parents[:, :3].eq(torch.tensor([-1, 0, 1])).all()
    assert tree.draft_logprobs[:, :3].eq(0).all()
    # real nodes: {3, 7} under the root, under 3 and under 7, then under the 3 best of those 4 (3->3, 3->7, 7->3)
    assert tree.num_nodes == 3 + 2 * 9
    assert tree.node_mask[:, :12].all() and not tree.node_mask[:, 12:].any()


@pytest.mark.parametrize("rep", [1, 3])
def test_few_queries_attention_equals_sdpa(rep):
    """`mtp_attention(few_queries=True)` (hf_bole's masked_attention: grouped heads without copies) equals SDPA over
    repeated keys with the boolean mask: rows that see one slot, all slots, or a scattered set."""
    torch.manual_seed(0)
    B, Hkv, Q, L, D = 2, 2, 3, 11, 8
    q = torch.randn(B, Hkv * rep, Q, D)
    k, v = torch.randn(2, B, Hkv, L, D)
    mask = torch.rand(B, 1, Q, L) < 0.5
    mask[0, 0, 0] = False
    mask[0, 0, 0, 4] = True  # one slot
    mask[1, 0, 2] = True  # every slot
    mask[..., 0] |= ~mask.any(-1)  # no row sees nothing
    out, weights = mtp_attention(None, q.transpose(1, 2).contiguous().transpose(1, 2), k, v, mask, scaling=0.3,
                                 few_queries=True)  # fmt: skip
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask, scale=0.3
    )
    assert weights is None
    torch.testing.assert_close(out, expected.transpose(1, 2), rtol=1e-5, atol=1e-5)


def test_rounds_attend_without_sdpa(monkeypatch):
    """A prompt's extension goes through SDPA (its scores would be [prompt, cache] per head), a round's steps never
    do: every tree step and a round's extension take hf_bole's masked_attention."""
    calls = []
    sdpa = head_module.sdpa_attention_forward
    monkeypatch.setattr(head_module, "sdpa_attention_forward", lambda *a, **kw: calls.append(a[1].shape) or sdpa(*a, **kw))
    model = _model(moe=False)
    rows = _rows([40, 12])
    drafter = _drafter(model, _mtp(model), depth=3, topk=2)
    drafter.propose(_ctx(rows, [0, 0], [30, 8], left_pad=True))  # the prompt: 30 entries, then 2 tree steps
    assert [shape[2] for shape in calls] == [30]
    calls.clear()
    for start, end in ((30, 34), (34, 35), (35, 40)):  # rounds of 4, 1 and 5 entries (depth + 1 = 4: 5 is a prompt)
        drafter.propose(_ctx(rows, [start, 8], [end, 12], positions=False))
    assert [shape[2] for shape in calls] == [5]


def _rounds(drafter, rows, bounds):
    """The trees of successive calls, call r bringing in entries `[bounds[b][r - 1], bounds[b][r])` of row b."""
    trees = []
    for r in range(1, len(bounds[0])):
        starts, ends = [bound[r - 1] for bound in bounds], [bound[r] for bound in bounds]
        trees.append(drafter.propose(_ctx(rows, starts, ends, positions=False)))
    return trees


def test_draft_over_the_whole_cache_length():
    """What CUDA graphs rely on: extending and drafting while attending over every slot of the cache (unused ones
    masked out) drafts the same trees as attending over the slots in use."""
    model = _model(moe=False)
    mtp = _mtp(model)
    rows = _rows([30, 12])
    drafter = _drafter(model, mtp, depth=3, topk=3)
    ctx = _ctx(rows, [0, 0], [30, 12], left_pad=True)
    eager = drafter.propose(ctx)
    # the roots again: extending by the same entries rewrites the same slots with the same values
    cache, committed = drafter._cache, torch.tensor([30, 12])
    cache.num_keys = cache.key.shape[2]
    assert cache.num_keys > cache.offset + 30  # slots past the longest row take part
    inputs = (ctx.hidden_states, ctx.next_tokens, ctx.new_mask, ctx.positions, committed)
    whole = drafter._round(cache, inputs, eager.num_nodes)
    _assert_same_trees(DraftTree(*whole), eager)


def test_replayed_rounds_read_their_static_inputs(monkeypatch):
    """The graphed path's bookkeeping on any device (a recorded call in place of a CUDA graph): every round's
    inputs reach the captured extension and expansion through its static buffers, one capture per (batch size,
    new entries, tree size); the prompt extends through a chunk's graph but for its last depth + 1 entries, drafted
    from by a replayed round."""
    model = _model(moe=False)
    mtp = _mtp(model)
    rows = _rows([60, 40])
    bounds = [[0, 7, 10, 12, 15, 17, 20], [0, 1, 2, 4, 7, 9, 12]]
    graphed = _drafter(model, mtp, 3, 2)
    captured = []
    monkeypatch.setattr(mtp_module, "capture", recording_capture(captured))
    monkeypatch.setattr(graphed, "_replays", lambda device: True)
    for tree, eager in zip(_rounds(graphed, rows, bounds), _rounds(_drafter(model, mtp, 3, 2), rows, bounds)):
        _assert_same_trees(tree, eager)
    # new entries per call: 7 (the prompt: 3 through a chunk's graph, its last 4 replayed), then 3, 2, 3, 2, 3
    assert sorted(key[1] for key in graphed._graphs) == [2, 3, 4] and list(graphed._extend_graphs) == [2]
    assert len(captured) == 4


@pytest.mark.parametrize("left_pad", [False, True])
def test_prompt_extension_replays_in_chunks(left_pad, monkeypatch):
    """Under graphs a prompt extends `_EXTEND_CHUNK` entries at a time through one captured chunk (recorded in place
    of a CUDA graph), ragged rows padded into their chunks, and drafts the trees of the eager extension, in that call
    and the next ones."""
    model = _model(moe=False)
    mtp = _mtp(model)
    rows = _rows([300, 40])
    bounds = [[0, 290, 293, 300], [0, 37, 39, 40]]
    monkeypatch.setattr(mtp_module, "_EXTEND_CHUNK", 64)
    graphed = _drafter(model, mtp, 3, 2)
    monkeypatch.setattr(mtp_module, "capture", recording_capture([]))
    monkeypatch.setattr(graphed, "_replays", lambda device: True)
    widths = []
    extend = graphed._extend

    def counted(cache, *inputs):
        widths.append(inputs[1].shape[1])
        return extend(cache, *inputs)

    monkeypatch.setattr(graphed, "_extend", counted)

    def calls(drafter):
        trees = []
        for r in range(1, len(bounds[0])):
            starts, ends = [bound[r - 1] for bound in bounds], [bound[r] for bound in bounds]
            ctx = _ctx(rows, starts, ends, positions=False, left_pad=left_pad)
            trees.append(drafter.propose(ctx))
        return trees

    for tree, eager in zip(calls(graphed), calls(_drafter(model, mtp, 3, 2))):
        _assert_same_trees(tree, eager)
    # _extend's calls by width. The prompt: 290 - 4 = 286 entries of the longer row, 5 chunks of 64 (the capture's
    # call, then a replay each), then its last 4 through a round (captured, replayed). The next call brings 3
    # entries (a round), the last one 7: 3 through the chunk's graph, then a round of 4.
    assert widths == [64] * 6 + [4, 4, 3, 3, 64, 4]
    assert list(graphed._extend_graphs) == [2]


@pytest.mark.parametrize("graphed", [False, True])
def test_compiled_rounds_are_one_graph_and_draft_the_same_trees(graphed, monkeypatch):
    """`compile=True`: dynamo traces a round's drafting (extension, every tree level, node ranking) whole, with no
    graph break (fullgraph), and the trees equal eager drafting's; the prompt extends eagerly. Traced on a
    counting backend that runs the graphs as traced: inductor's code is exercised on the GPU."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    monkeypatch.setattr(torch, "compile", lambda fn: torch._dynamo.optimize(counter, nopython=True)(fn))
    torch._dynamo.reset()  # sizes seen changing by earlier tests' compiles are kept per code object
    model = _model(moe=False)
    mtp = _mtp(model)
    rows = _rows([60, 40])
    bounds = [[0, 7, 10, 12, 15, 17, 20], [0, 1, 2, 4, 7, 9, 12]]
    compiled = _drafter(model, mtp, 3, 2, compile=True)
    if graphed:
        monkeypatch.setattr(mtp_module, "capture", recording_capture([]))
        monkeypatch.setattr(compiled, "_replays", lambda device: True)
    trees = _rounds(compiled, rows, bounds)
    for tree, eager in zip(trees, _rounds(_drafter(model, mtp, 3, 2), rows, bounds)):
        _assert_same_trees(tree, eager)
    # the prompt's first 3 entries eagerly; its last 4 and the rounds compiled: static, then with the sizes that
    # changed symbolic
    assert counter.frame_count == 2


@pytest.mark.parametrize("depth", [2, 5])
def test_rotary_embedding_once_for_all_tree_levels(depth, monkeypatch):
    """Every node of a level sits at the same position, root + level: a call computes the rotary embedding once for
    its new entries and once for all tree levels, at any depth (one a level before), at those positions."""
    model = _model(moe=False)
    rotary = model.get_decoder().rotary_emb
    forward, seen = rotary.forward, []
    monkeypatch.setattr(rotary, "forward", lambda x, ids: seen.append(ids[0].clone()) or forward(x, ids))
    rows = _rows([30, 20])
    drafter = _drafter(model, _mtp(model), depth=depth, topk=2)
    drafter.propose(_ctx(rows, [0, 0], [20, 12], left_pad=True))  # a prompt: the eager extension comes first
    seen.clear()
    drafter.propose(_ctx(rows, [20, 12], [22, 13], positions=False))  # a round
    assert len(seen) == 2
    levels = torch.arange(1, depth).expand(2, -1)
    assert torch.equal(seen[1], torch.tensor([[21], [12]]) + levels)  # each row's root entry: position 21 and 12


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_fused_projections_run_fewer_gemms_and_draft_the_same_trees(moe, monkeypatch):
    """`fuse_projections=True`: q, k and v run as one GEMM, and gate and up (the MoE's shared expert's) as another,
    so every MTP forward makes 3 fewer `F.linear` calls; the trees equal those of the head run projection by
    projection, and afterwards the head's plain forward computes what it did."""
    model = _model(moe)
    mtp = _mtp(model)
    rows = _rows([20, 13])
    bounds = [[0, 7, 10, 12], [0, 4, 7, 8]]
    x = (torch.randn(2, 3, HIDDEN), torch.randn(2, 3, HIDDEN))
    rope = model.get_decoder().rotary_emb(x[0], torch.arange(3).expand(3, 2, -1))
    with torch.no_grad():
        before = mtp(*x, rope)
    calls = []
    linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a, **k: calls.append(1) or linear(*a, **k))
    counts, trees = [], []
    for fuse in (False, True):
        calls.clear()
        trees.append(_rounds(_drafter(model, mtp, 3, 2, fuse=fuse), rows, bounds))
        counts.append(len(calls))
    # a call's forwards: the eager extension by all but the prompt's last depth + 1 entries (once), then per call the
    # extension and depth - 1 tree levels (3 calls)
    forwards = 1 + 3 * 3
    assert counts[0] - counts[1] == 3 * forwards
    for tree, apart in zip(*trees[::-1]):
        _assert_same_trees(tree, apart)
    with torch.no_grad():
        torch.testing.assert_close(mtp(*x, rope), before, rtol=0, atol=0)


def test_fused_projections_compile_whole(monkeypatch):
    """The fused projections' parts trace within a compiled round with no graph break (nopython), as many
    compiles as without them, and draft the same trees."""
    from torch._dynamo.testing import CompileCounter

    model = _model(moe=False)
    mtp = _mtp(model)
    rows = _rows([30, 20])
    bounds = [[0, 7, 10, 12, 15], [0, 1, 2, 4, 7]]
    frames = []
    for fuse in (False, True):
        counter = CompileCounter()
        monkeypatch.setattr(torch, "compile", lambda fn, c=counter: torch._dynamo.optimize(c, nopython=True)(fn))
        torch._dynamo.reset()
        trees = _rounds(_drafter(model, mtp, 3, 2, compile=True, fuse=fuse), rows, bounds)
        frames.append(counter.frame_count)
    assert frames[0] == frames[1] > 0
    for tree, eager in zip(trees, _rounds(_drafter(model, mtp, 3, 2), rows, bounds)):
        _assert_same_trees(tree, eager)


def test_every_drafter_compiles_past_dynamos_own_limit(monkeypatch, caplog):
    """dynamo counts compiles per code object, so drafters of every depth share `_round`'s: with its limit reached
    (1 here, 8 by default) later drafters drafted uncompiled with a log line only (on an H200, trees of depth 8 and
    deeper in a sweep of depths). hf_bole's limit is its own; past it a drafter says
    so and drafts the same trees uncompiled."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    monkeypatch.setattr(torch, "compile", lambda fn: torch._dynamo.optimize(counter, nopython=True)(fn))
    torch._dynamo.reset()
    model = _model(moe=False)
    mtp = _mtp(model)
    rows = _rows([12, 9])
    bounds = [[0, 7, 10], [0, 4, 7]]  # a prompt (its last depth + 1 entries compiled), then a round
    # dynamo's own patch: monkeypatch's undo left dynamo's config without the key, and later tests' compiles failed
    with torch._dynamo.config.patch(recompile_limit=1):
        for depth in (1, 2, 3):
            before = counter.frame_count
            _rounds(_drafter(model, mtp, depth, 2, compile=True), rows, bounds)
            assert counter.frame_count > before, f"depth {depth} drafted uncompiled"
        monkeypatch.setattr(mtp_module, "_RECOMPILE_LIMIT", 1)
        with caplog.at_level(logging.WARNING):
            trees = _rounds(_drafter(model, mtp, 4, 2, compile=True), rows, bounds)
    assert "drafts uncompiled from now on" in caplog.text
    for tree, eager in zip(trees, _rounds(_drafter(model, mtp, 4, 2), rows, bounds)):
        _assert_same_trees(tree, eager)


@pytest.mark.skipif(not torch.empty(0).is_cuda, reason="CUDA graphs need a GPU (HF_BOLE_TEST_DEVICE=cuda)")
@pytest.mark.parametrize("compile", [False, True])
def test_cuda_graphs_match_eager_drafting(compile):
    """Replayed trees equal eager ones over rounds of different lengths, batch sizes and a cache that grows; with
    `compile`, the graphs capture inductor's code for the rounds."""
    model = _model(moe=False)
    mtp = _mtp(model)
    rows = _rows([300, 40])
    # Calls bringing in up to depth + 1 = 4 entries replay round graphs; longer ones extend through a chunk's graph
    # but for their last 4 (the sixth grows the cache past 256 entries, which drops the graphs).
    bounds = [
        [0, 7, 10, 12, 200, 203, 290, 293, 300],
        [0, 1, 2, 4, 17, 20, 37, 39, 40],
    ]
    graphed = MTPDrafter(
        mtp, model.get_input_embeddings(), model.get_output_embeddings(), model.get_decoder().rotary_emb,
        depth=3, topk=2, cuda_graphs=True, compile=compile,
    )  # fmt: skip
    first = _rounds(graphed, rows, [b[:3] for b in bounds])
    assert graphed._graphs  # captured, not drafted eagerly
    # Memory of the first graphs' pool still held when the cache grows and they are dropped (the harness hit
    # PyTorch's allocator assert when the next capture reused that pool).
    held = next(iter(graphed._graphs.values())).tree
    later = _rounds(graphed, rows, [b[2:] for b in bounds])
    for tree, eager in zip(first + later, _rounds(_drafter(model, mtp, 3, 2), rows, bounds)):
        _assert_same_trees(tree, eager)
    assert held.tokens.is_cuda
    single = _rounds(graphed, rows[:1], [bounds[0][:3]])  # another batch size: a graph of its own
    for tree, eager in zip(single, _rounds(_drafter(model, mtp, 3, 2), rows[:1], [bounds[0][:3]])):
        _assert_same_trees(tree, eager)


def test_cuda_graphs_refused_for_eager_experts(caplog):
    """An MTP layer whose experts run transformers' "eager" implementation routes with data-dependent shapes: no
    capture, and a warning that names it; under "batched_mm" it is captured (and under "grouped_mm", the default,
    in bf16: test_graphs.py)."""
    model = _model(moe=True)
    for implementation, captured in (("batched_mm", True), ("eager", False)):
        model.set_experts_implementation(implementation)  # the MTP layer copies the target's config when built
        with caplog.at_level(logging.WARNING):
            drafter = MTPDrafter(
                _mtp(model), model.get_input_embeddings(), model.get_output_embeddings(),
                model.get_decoder().rotary_emb, depth=2, topk=2, cuda_graphs=True,
            )  # fmt: skip
        assert drafter.cuda_graphs == captured
    assert "experts_implementation='eager'" in caplog.text

def test_wide_topk_drafts_with_torch_topk_and_says_so(caplog):
    """Above row_topk's MAX_K the drafter picks children with torch.topk (a warning says so) and drafts the same
    trees as the plain recursion's top-k."""
    model = _model(moe=False)
    mtp = _mtp(model)
    rows = _rows([6])
    with caplog.at_level(logging.WARNING):
        drafter = _drafter(model, mtp, depth=2, topk=MAX_K + 1)
    assert "slower on a GPU" in caplog.text
    tree = drafter.propose(_ctx(rows, [0], [6]))
    tree.validate(batch_size=1, vocab_size=VOCAB)
    ref = _Sequential(model, mtp, *rows[0])
    roots = set(tree.tokens[0, tree.parents[0] == -1].tolist())
    assert roots == set(ref.log_probs(()).topk(MAX_K + 1).indices.tolist())
