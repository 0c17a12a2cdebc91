"""Greedy and sampling acceptance over verify trees; applying logits processors to tree nodes."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers.generation.logits_process import (
    ClassifierFreeGuidanceLogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from hf_bole.generation import (
    DraftTree,
    VerifyTree,
    accept_greedy,
    accept_sampling,
    check_logits_processor,
    is_context_free,
    process_logits,
    select_nodes,
)
from hf_bole.generation.select import roots_only

V = 10  # vocabulary of the hand-built cases


def _vtree(rows: list[tuple[list[int], list[int]]]) -> VerifyTree:
    """Verify trees from per-row (tokens with the root first, parents with -1 for the root), padded to one width."""
    T = max(len(tokens) for tokens, _ in rows)
    ids, par, dep, mask = [], [], [], []
    for tokens, parents in rows:
        n = len(tokens)
        depth = []
        for p in parents:
            depth.append(0 if p < 0 else depth[p] + 1)
        ids.append(tokens + [0] * (T - n))
        par.append(parents + [-1] * (T - n))
        dep.append(depth + [0] * (T - n))
        mask.append([True] * n + [False] * (T - n))
    return VerifyTree(
        input_ids=torch.tensor(ids),
        parents=torch.tensor(par),
        depths=torch.tensor(dep),
        draft_index=torch.where(torch.tensor(mask), torch.arange(T) - 1, -1),
        node_mask=torch.tensor(mask),
        num_nodes=torch.tensor([len(tokens) for tokens, _ in rows]),
    )


def _argmax_scores(argmax: list[list[int]]) -> torch.Tensor:
    """`[B, T, V]` logits whose argmax at node (b, i) is `argmax[b][i]`."""
    noise = torch.randn(len(argmax), len(argmax[0]), V)
    return torch.nn.functional.one_hot(torch.tensor(argmax), V).float() * 5 + noise


CHAIN = ([9, 1, 2, 3], [-1, 0, 1, 2])  # root 9 -> 1 -> 2 -> 3
# root 9 -> a(1), b(2), c(3); b -> d(5), e(6); e -> f(7)
BUSHY = ([9, 1, 2, 3, 5, 6, 7], [-1, 0, 0, 0, 2, 2, 5])


@pytest.mark.parametrize(
    "tree, argmax, path, tokens",
    [
        # full match: 1, 2, 3 accepted, then the bonus 4 from the last node
        pytest.param(CHAIN, [1, 2, 3, 4], [0, 1, 2, 3], [1, 2, 3, 4], id="chain-full"),
        # the target wants 8 after 1: accept 1, bonus 8
        pytest.param(CHAIN, [1, 8, 3, 4], [0, 1], [1, 8], id="chain-partial"),
        # no child of the root is the argmax 4: only the bonus
        pytest.param(CHAIN, [4, 2, 3, 4], [0], [4], id="chain-none"),
        # root wants 2 (b), b wants 6 (e), e wants 7 (f), f wants 0: path b, e, f then bonus 0
        pytest.param(BUSHY, [2, 0, 6, 0, 0, 7, 0], [0, 2, 5, 6], [2, 6, 7, 0], id="bushy-deep"),
        # root wants 3 (c, a leaf): accept c, bonus from c's argmax 8
        pytest.param(BUSHY, [3, 0, 6, 8, 0, 7, 0], [0, 3], [3, 8], id="bushy-leaf"),
        # root wants 2 (b) but b wants 4, neither d nor e: accept b, bonus 4
        pytest.param(BUSHY, [2, 0, 4, 0, 0, 7, 0], [0, 2], [2, 4], id="bushy-stop"),
    ],
)
def test_accept_greedy(tree, argmax, path, tokens):
    out = accept_greedy(_vtree([tree]), _argmax_scores([argmax]))
    T = len(tree[0])
    assert out.path.tolist() == [path + [-1] * (T - len(path))]
    assert out.tokens.tolist() == [tokens + [-1] * (T - len(tokens))]
    assert out.accept_lengths.tolist() == [len(tokens)]
    assert out.bonus.tolist() == [tokens[-1]] and out.leaf.tolist() == [path[-1]]


def test_accept_greedy_rows_differ():
    # row 0: the bushy tree accepts b, e, f (+ bonus 0); row 1: a chain padded to the same width accepts
    # nothing (root wants 5); row 2: root only (no drafts), bonus 7. Padding node tokens (0) equal to the
    # target token at the root must never be accepted.
    tree = _vtree([BUSHY, CHAIN, ([9], [-1])])
    scores = _argmax_scores([[2, 0, 6, 0, 0, 7, 0], [5, 2, 3, 4, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0]])
    scores[2, 0] = torch.nn.functional.one_hot(torch.tensor(7), V) * 9.0
    scores[1, 0, 0] = 100.0  # row 1's root now prefers 0, the token of its padding nodes
    out = accept_greedy(tree, scores)
    assert out.accept_lengths.tolist() == [4, 1, 1]
    assert out.tokens[:, :4].tolist() == [[2, 6, 7, 0], [0, -1, -1, -1], [7, -1, -1, -1]]
    assert out.path[:, :4].tolist() == [[0, 2, 5, 6], [0, -1, -1, -1], [0, -1, -1, -1]]


def test_accept_greedy_duplicate_siblings_take_the_first():
    # root -> x(1) at index 1, y(1) at index 2 with child z(5). The walk goes to the first child carrying the
    # argmax 1, i.e. x, and never looks below y: accept x, bonus 8 (x's argmax)
    tree = _vtree([([9, 1, 1, 5], [-1, 0, 0, 2])])
    out = accept_greedy(tree, _argmax_scores([[1, 8, 5, 0]]))
    assert out.tokens.tolist() == [[1, 8, -1, -1]] and out.path.tolist() == [[0, 1, -1, -1]]


def _peaked(argmax: list[list[int]]) -> torch.Tensor:
    """Scores that put all mass on one token per node (-inf elsewhere): sampling is then deterministic."""
    return torch.where(torch.nn.functional.one_hot(torch.tensor(argmax), V).bool(), 0.0, float("-inf"))


def test_accept_sampling_point_masses_match_greedy():
    tree = _vtree([BUSHY, CHAIN, ([9], [-1])])
    argmax = [[2, 0, 6, 0, 0, 7, 0], [1, 2, 8, 0, 0, 0, 0], [4, 0, 0, 0, 0, 0, 0]]
    out = accept_sampling(tree, _peaked(argmax))
    # row 0: b, e, f then 0; row 1: 1, 2 then 8; row 2: bonus 4
    assert out.tokens[:, :4].tolist() == [[2, 6, 7, 0], [1, 2, 8, -1], [4, -1, -1, -1]]
    assert out.accept_lengths.tolist() == [4, 3, 1]


def test_accept_sampling_bonus_is_never_a_child():
    # root -> 1, 2 (leaves). Uniform target over 4 tokens: either a child is followed (then the bonus comes from
    # the child's point mass, token 7) or the bonus at the root is 0 or 3, never a child token
    tree = _vtree([([9, 1, 2], [-1, 0, 0])] * 4000)
    scores = torch.full((4000, 3, V), float("-inf"))
    scores[:, 0, :4] = 0.0
    scores[:, 1:, 7] = 0.0
    out = accept_sampling(tree, scores)
    stopped = out.accept_lengths == 1
    assert set(out.bonus[stopped].tolist()) == {0, 3}
    assert set(out.tokens[~stopped, 0].tolist()) == {1, 2} and set(out.bonus[~stopped].tolist()) == {7}
    # each of the four outcomes has probability 1/4
    assert abs(stopped.float().mean().item() - 0.5) < 0.05


def test_accept_sampling_uses_torch_rng():
    tree = _vtree([BUSHY] * 64)
    scores = torch.randn(64, 7, V)
    torch.manual_seed(0)
    first = accept_sampling(tree, scores)
    torch.manual_seed(0)
    second = accept_sampling(tree, scores)
    other = accept_sampling(tree, scores, generator=torch.Generator(torch.get_default_device()).manual_seed(0))
    again = accept_sampling(tree, scores, generator=torch.Generator(torch.get_default_device()).manual_seed(0))
    assert torch.equal(first.tokens, second.tokens) and torch.equal(other.tokens, again.tokens)


# ---- statistical test: the first three emitted tokens have the target's joint distribution -------------------

SV = 4  # vocabulary of the statistical test: 4^3 = 64 outcomes for three tokens


def _target_logits(context: tuple[int, ...]) -> torch.Tensor:
    """A fixed, context-dependent next-token distribution (the toy target model)."""
    seed = 1 + sum((t + 1) * 5**k for k, t in enumerate(context[:3]))
    return torch.randn(SV, generator=torch.Generator(torch.get_default_device()).manual_seed(seed)) * 1.2


def _draft(context: tuple[int, ...], kind: str) -> list[tuple[tuple[int, ...], float]]:
    """Draft nodes below `context` as (path, draft prob): top-k by the target ("good"), by the reverse ("bad"),
    or a deterministic pseudo-random chain ("chain")."""
    def children(path, k, sign):
        probs = (sign * _target_logits(context + path)).softmax(-1)
        top = probs.topk(k)
        return [(path + (t,), p) for t, p in zip(top.indices.tolist(), top.values.tolist())]

    if kind == "chain":
        path, nodes = (), []
        for _ in range(3):
            t = (sum(context + path) * 7 + 3) % SV
            path = path + (t,)
            nodes.append((path, 0.5))
        return nodes
    sign = 1.0 if kind == "good" else -1.0
    level, nodes = [((), 1.0)], []
    for _ in range(3):
        level = [(c, p * q) for path, p in level for c, q in children(path, 2, sign)]
        nodes += level
    return nodes


def _draft_tree(contexts: list[tuple[int, ...]], kind: str) -> DraftTree:
    rows = []
    for context in contexts:
        nodes = _draft(context, kind)
        index = {path: i for i, (path, _) in enumerate(nodes)}
        rows.append(
            (
                [path[-1] for path, _ in nodes],
                [index.get(path[:-1], -1) for path, _ in nodes],
                [p for _, p in nodes],
            )
        )
    N = max(len(r[0]) for r in rows)
    return DraftTree(
        tokens=torch.tensor([r[0] + [0] * (N - len(r[0])) for r in rows]),
        parents=torch.tensor([r[1] + [-1] * (N - len(r[1])) for r in rows]),
        draft_logprobs=torch.tensor([r[2] + [0.0] * (N - len(r[2])) for r in rows]).log(),
    )


def _node_logits(vt: VerifyTree, contexts: list[tuple[int, ...]]) -> torch.Tensor:
    """`[U, T, SV]`: the toy target's logits at every verify node (its context followed by its path)."""
    logits = torch.zeros(len(contexts), vt.input_ids.shape[1], SV)
    for u, context in enumerate(contexts):
        for i in range(vt.input_ids.shape[1]):
            path, j = [], i
            while j > 0:
                path.append(vt.input_ids[u, j].item())
                j = vt.parents[u, j].item()
            logits[u, i] = _target_logits(context + tuple(reversed(path)))
    return logits


def _sample_three(kind: str, processors: LogitsProcessorList, budget: int, n: int) -> torch.Tensor:
    """Runs rounds of draft -> select -> accept for `n` independent requests until each emitted 3 tokens."""
    emitted = [[] for _ in range(n)]
    while any(len(e) < 3 for e in emitted):
        active = [r for r in range(n) if len(emitted[r]) < 3]
        contexts = sorted({tuple(emitted[r]) for r in active})
        which = {c: u for u, c in enumerate(contexts)}
        tree = _draft_tree(contexts, kind)
        roots = torch.zeros(len(contexts), dtype=torch.long)
        # budget 0: the roots alone, as the decoding loop verifies them (no selection)
        vt = roots_only(roots) if budget == 0 else select_nodes(tree, roots, budget, 127)
        logits = _node_logits(vt, contexts)
        scores = process_logits(processors, logits, vt, contexts=[torch.tensor(c) for c in contexts])
        rows = torch.tensor([which[tuple(emitted[r])] for r in active])
        fields = {k: getattr(vt, k) for k in vt.__dataclass_fields__}
        batch = VerifyTree(**{k: None if v is None else v[rows] for k, v in fields.items()})
        out = accept_sampling(batch, scores[rows])
        for r, toks, k in zip(active, out.tokens.tolist(), out.accept_lengths.tolist()):
            emitted[r] += toks[:k]
    return torch.tensor([e[:3] for e in emitted])


def _expected(processors: LogitsProcessorList, sharpen: float = 1.0) -> dict[tuple[int, ...], float]:
    def p(context):
        scores = processors(torch.tensor([context or (0,)]), _target_logits(context)[None] * sharpen)
        return scores.softmax(-1)[0]

    return {
        (a, b, c): (p(()) [a] * p((a,))[b] * p((a, b))[c]).item()
        for a in range(SV)
        for b in range(SV)
        for c in range(SV)
    }


def _chi2_pvalue(samples: torch.Tensor, expected: dict[tuple[int, ...], float]) -> float:
    from scipy.stats import chisquare  # imported here: GPU images without scipy still run the other tests

    n = samples.shape[0]
    observed = Counter(map(tuple, samples.tolist()))
    assert all(expected[cell] > 0 for cell in observed), "a token outside the target's support was emitted"
    # cells with small expected counts are pooled so the chi-square approximation holds
    big = [cell for cell, q in expected.items() if q * n >= 5]
    f_obs = [observed[c] for c in big] + [n - sum(observed[c] for c in big)]
    f_exp = [expected[c] * n for c in big] + [n - sum(expected[c] * n for c in big)]
    if f_exp[-1] < 1e-9:
        f_obs, f_exp = f_obs[:-1], f_exp[:-1]
    return chisquare(f_obs, f_exp).pvalue


@pytest.mark.parametrize(
    "kind, processors, budget",
    [
        pytest.param("good", LogitsProcessorList(), 10**6, id="good-drafts"),
        pytest.param("bad", LogitsProcessorList(), 10**6, id="bad-drafts"),
        pytest.param("chain", LogitsProcessorList(), 10**6, id="chain-draft"),
        pytest.param("good", LogitsProcessorList(), 5, id="good-drafts-budget5"),
        pytest.param("good", LogitsProcessorList(), 0, id="roots-alone"),
        pytest.param(
            "bad",
            LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(3)]),
            10**6,
            id="bad-drafts-temp-topk",
        ),
    ],
)
def test_accept_sampling_is_lossless(kind, processors, budget):
    samples = _sample_three(kind, processors, budget, n=6000)
    expected = _expected(processors)
    # H0: the emitted triples follow p(y1) p(y2 | y1) p(y3 | y1 y2); a fixed seed makes the p-value reproducible
    assert _chi2_pvalue(samples, expected) > 1e-3
    # the same samples against a slightly sharper target must be rejected: the test has power at this size
    assert _chi2_pvalue(samples, _expected(processors, sharpen=1.25)) < 1e-4


@pytest.mark.parametrize("kind", ["good", "bad"])
def test_accept_sampling_reaches_the_optimal_acceptance(kind):
    # A node is accepted exactly when the emitted tokens spell its path, so E[tokens per round] is
    # 1 + sum over nodes of p_target(path): the most any lossless rule can reach (docs/acceptance.md).
    n = 20000
    vt = select_nodes(_draft_tree([()], kind), torch.zeros(1, dtype=torch.long), 10**6, 127)
    logprobs = _node_logits(vt, [()]).log_softmax(-1)[0]  # [T, SV]
    path_logprob = torch.zeros(vt.input_ids.shape[1])
    for i in range(1, vt.num_nodes[0].item()):  # parents come first
        parent = vt.parents[0, i].item()
        path_logprob[i] = path_logprob[parent] + logprobs[parent, vt.input_ids[0, i]]
    optimum = 1 + path_logprob[1 : vt.num_nodes[0].item()].exp().sum().item()
    batch = VerifyTree(**{k: getattr(vt, k).expand(n, *getattr(vt, k).shape[1:]) for k in vt.__dataclass_fields__})
    lengths = accept_sampling(batch, _node_logits(vt, [()]).expand(n, -1, -1)).accept_lengths.float()
    assert abs(lengths.mean().item() - optimum) < 4 * lengths.std().item() / n**0.5
    # the toy drafts differ as intended: top-k by the target reach ~2.5 tokens a round, reversed ones ~1.5
    assert (optimum > 2.2) if kind == "good" else (optimum < 1.7)


# ---- logits processors on tree nodes -------------------------------------------------------------------------


def _processor_case():
    # three rows with committed contexts of different lengths (left padding 0 in the first, as generate holds it)
    contexts = [torch.tensor([0, 0, 4, 5, 6]), torch.tensor([4, 4, 7]), torch.tensor([1, 2, 3, 4, 5, 6, 8])]
    tree = _vtree(
        [
            ([6, 5, 6, 7, 6], [-1, 0, 1, 2, 0]),  # a chain of depth 3 plus a second root child
            ([7, 4, 7], [-1, 0, 0]),
            ([8], [-1]),
        ]
    )
    logits = torch.randn(3, 5, V)
    return contexts, tree, logits


def _node_sequence(contexts, tree, b: int, i: int) -> torch.Tensor:
    """Node i of row b's full sequence: its row's context, then the tokens on its path below the root."""
    path, j = [], i
    while j > 0:
        path.append(tree.input_ids[b, j].item())
        j = tree.parents[b, j].item()
    return torch.cat([contexts[b], torch.tensor(path[::-1], dtype=torch.long)])


def _per_node(processors, contexts, tree, logits) -> torch.Tensor:
    """The reference: every real node's logits processed alone, with its full sequence as input_ids."""
    out = logits.clone()
    for b in range(tree.input_ids.shape[0]):
        for i in range(tree.num_nodes[b].item()):
            seq = _node_sequence(contexts, tree, b, i)
            out[b, i] = processors(seq[None], logits[b, i][None].clone())[0]
    return out


class _RowBias:
    """Treats batch rows differently: +3 on token `(7 * row + 3) % V` of row `row` (plain decoding's `input_ids` has
    one row per request)."""

    def __call__(self, input_ids, scores):
        assert input_ids.shape[0] == 3, "called with the batch's rows"
        rows = torch.arange(scores.shape[0])
        scores = scores.clone()
        scores[rows, (7 * rows + 3) % V] += 3
        return scores


def _per_node_in_row(processors, contexts, tree, logits) -> torch.Tensor:
    """The reference for processors that read a row's place: every real node's logits processed alone, its sequence
    in its row of a batch of them (the other rows padding)."""
    out = logits.clone()
    B = tree.input_ids.shape[0]
    for b in range(B):
        for i in range(tree.num_nodes[b].item()):
            seq = _node_sequence(contexts, tree, b, i)
            ids = torch.zeros(B, len(seq), dtype=torch.long)
            ids[b] = seq
            scores = torch.zeros(B, logits.shape[-1])
            scores[b] = logits[b, i]
            out[b, i] = processors(ids, scores)[b]
    return out


@pytest.mark.parametrize(
    "processors",
    [
        pytest.param([TemperatureLogitsWarper(0.7), TopKLogitsWarper(4), TopPLogitsWarper(0.8)], id="context-free"),
        pytest.param([RepetitionPenaltyLogitsProcessor(1.7), TemperatureLogitsWarper(0.7)], id="repetition"),
        pytest.param([NoRepeatNGramLogitsProcessor(2)], id="no-repeat-ngram"),
        pytest.param(
            [MinNewTokensLengthLogitsProcessor(
                    prompt_length_to_skip=4, min_new_tokens=3, eos_token_id=[1, 2], device=torch.get_default_device()
                )],
            id="min-new-tokens",
        ),
        pytest.param(
            [RepetitionPenaltyLogitsProcessor(1.3, prompt_ignore_length=2), TopKLogitsWarper(3)], id="mixed"
        ),
        pytest.param([_RowBias()], id="row-bias"),
        pytest.param([RepetitionPenaltyLogitsProcessor(1.3), _RowBias(), TopKLogitsWarper(3)], id="row-bias-mixed"),
        pytest.param([PrefixConstrainedLogitsProcessor(lambda b, ids: [b, 2 * b, int(ids[-1])], 1)], id="prefix"),
    ],
)
def test_process_logits_equals_per_sequence(processors):
    """Each node's logits processed as plain decoding processes them: its sequence in its row's place of the batch
    (processors that treat rows differently included)."""
    processors = LogitsProcessorList(processors)
    contexts, tree, logits = _processor_case()
    scores = process_logits(processors, logits, tree, contexts)
    expected = _per_node_in_row(processors, contexts, tree, logits)
    mask = tree.node_mask
    torch.testing.assert_close(scores[mask], expected[mask], rtol=0, atol=0)
    assert not torch.equal(scores[mask], logits[mask])  # the case is not vacuous
    assert scores.dtype == torch.float32 and not scores.isnan().any()


def test_process_logits_per_row_repetition_penalty():
    """generate's repetition penalty skips each row's left padding: a per-row `prompt_ignore_length`."""
    ignore = torch.tensor([2, 0, 3])  # per row
    try:
        RepetitionPenaltyLogitsProcessor(1.3, prompt_ignore_length=ignore)
    except ValueError:
        pytest.skip("this transformers takes one prompt_ignore_length for all rows (per-row came after 5.17)")
    contexts, tree, logits = _processor_case()
    scores = process_logits(
        LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3, prompt_ignore_length=ignore)]), logits, tree, contexts
    )
    for b in range(tree.input_ids.shape[0]):
        row = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3, prompt_ignore_length=int(ignore[b]))])
        expected = _per_node(row, contexts, tree, logits)
        mask = tree.node_mask[b]
        torch.testing.assert_close(scores[b][mask], expected[b][mask], rtol=0, atol=0)


def test_process_logits_without_processors_copies():
    contexts, tree, logits = _processor_case()
    scores = process_logits(None, logits.bfloat16(), tree, contexts)
    assert scores.dtype == torch.float32 and torch.equal(scores, logits.bfloat16().float())


def test_context_free_detection():
    assert is_context_free(LogitsProcessorList([TemperatureLogitsWarper(0.5), TopPLogitsWarper(0.9)]))
    assert is_context_free(None)
    assert not is_context_free(LogitsProcessorList([TemperatureLogitsWarper(0.5), NoRepeatNGramLogitsProcessor(2)]))


@pytest.mark.parametrize(
    "processor, message",
    [
        pytest.param(ClassifierFreeGuidanceLogitsProcessor(1.5), "batch halves", id="guidance"),
    ],
)
def test_check_logits_processor_rejects(processor, message):
    with pytest.raises(ValueError, match=message):
        check_logits_processor(LogitsProcessorList([processor]))
