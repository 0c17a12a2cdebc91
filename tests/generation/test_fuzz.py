"""Random requests against plain greedy `generate`: settings, drafters (random trees too), paddings, batch sizes,
processors and stopping rules, seeded and bounded in time.

Every case is drawn from its own seed (`HF_BOLE_FUZZ_SEED`, default 0, plus the case's number), so a failure names
what reproduces it: `HF_BOLE_FUZZ_SEED=<seed> HF_BOLE_FUZZ_CASES=1 python -m pytest tests/generation/test_fuzz.py
-k torch` (a case through the Triton kernels: its seed minus 10**6, and `-k triton`).
Cases run until `HF_BOLE_FUZZ_SECONDS` (default 30) have passed, or `HF_BOLE_FUZZ_CASES` of them; through the
Triton kernels (under the interpreter on a CPU) for a share of that time, cases of their own.
"""

from __future__ import annotations

import os
import random
import time

import pytest
import torch
from transformers import LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from hf_bole.generation import DraftContext, DraftTree, plan
from hf_bole.generation.prefill import unchainable
from hf_bole.models.mtp import Qwen3_5MTP, save_pretrained_with_mtp
from tests.generation.test_loop import Recorder, RowBias, _char, _tokenizer, padded_tree
from tests.models import tiny

SECONDS = float(os.environ.get("HF_BOLE_FUZZ_SECONDS", 30))
CASES = int(os.environ.get("HF_BOLE_FUZZ_CASES", 10**6))
SEED = int(os.environ.get("HF_BOLE_FUZZ_SEED", 0))


class RandomTreeDrafter:
    """Random trees: random tokens under random parents, and, with probability `truth`, a branch along each row's
    plain greedy continuation (so that paths several nodes deep are accepted). With `max_depth` it reads only
    `ctx.lengths` (the loop pipelines its rounds) and keeps its trees that shallow."""

    def __init__(self, seed: int, real_lengths: list[int], continuations: list[list[int]], max_depth, truth: float):
        self.rng = random.Random(seed)
        self.real_lengths, self.continuations, self.truth = real_lengths, continuations, truth
        if max_depth is not None:
            self.max_depth = max_depth
        self.depth_cap = max_depth or 8

    def propose(self, ctx: DraftContext) -> DraftTree:
        rows = []
        for b, length in enumerate(ctx.lengths.tolist()):
            done = length - self.real_lengths[b]  # tokens generated so far, the root included
            rows.append(self._row(self.continuations[b][done:], ctx.max_nodes))
        return padded_tree(rows)

    def _row(self, truth: list[int], max_nodes: int):
        rng = self.rng
        tokens, parents, depths, logp = [], [], [], []
        children: dict[int, set[int]] = {}

        def add(token, parent):
            if token in children.setdefault(parent, set()) or len(tokens) >= max_nodes:
                return None
            depth = 1 if parent < 0 else depths[parent] + 1
            if depth > self.depth_cap:
                return None
            children[parent].add(token)
            tokens.append(token)
            parents.append(parent)
            depths.append(depth)
            logp.append(-rng.random() * 3)
            return len(tokens) - 1

        if rng.random() < self.truth:
            parent = -1
            for token in truth[: rng.randint(1, self.depth_cap)]:
                parent = add(token, parent)
                if parent is None:
                    break
        for _ in range(rng.randint(0, max_nodes)):
            parent = rng.randint(-1, len(tokens) - 1)
            add(rng.randrange(tiny.VOCAB), parent)
        return tokens, parents, logp


class StopsOn(StoppingCriteria):
    """A user's criterion (called with each row's ids, token by token): stops a row on `token`."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Dense with an MTP head (saved and loaded back, as a checkpoint is), and a mixture of experts."""
    dense = tiny.build_model("dense")
    folder = tmp_path_factory.mktemp("fuzz_mtp")
    save_pretrained_with_mtp(dense, Qwen3_5MTP.for_model(dense), folder)
    with_mtp = type(dense).from_pretrained(folder, attn_implementation="sdpa").to(dense.device).eval()
    return {"dense": with_mtp, "moe": tiny.build_model("moe"), "vl": tiny.build_model("vl")}


def _batch(rng: random.Random, rows: int, padding: str, long: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """`(input_ids, attention_mask)` `[rows, P]` of random prompts, padded as `padding` says (a row of padding alone
    now and then), with `long` a few longer than a prefill chain of 128."""
    longest = 140 if long and rng.random() < 0.1 else 10
    lengths = [rng.randint(1, longest) if padding == "none" or rng.random() > 0.1 else 0 for _ in range(rows)]
    lengths[0] = max(lengths[0], 1)
    P = max(lengths) + (rng.randint(0, 3) if padding != "none" else 0)
    ids = torch.tensor([[rng.randrange(1, tiny.VOCAB) for _ in range(P)] for _ in range(rows)])
    mask = torch.zeros(rows, P, dtype=torch.long)
    for b, n in enumerate(lengths):
        if padding == "none":
            mask[b] = 1
        elif padding == "left":
            mask[b, P - n :] = 1
        elif padding == "right":
            mask[b, :n] = 1
        else:  # holes: real tokens at random columns
            columns = sorted(rng.sample(range(P), n))
            mask[b, columns] = 1
    ids = torch.where(mask.bool(), ids, 0)
    return ids, mask


def _case(seed: int, models, light: bool = False) -> tuple[dict, str]:
    """Draws and runs one case (`light`: short prompts and outputs, at most two rows); returns its settings and "ok" or
    "refused: <message>"."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    kind = rng.choice(["dense", "dense", "moe", "vl"])
    model = models[kind]
    rows = rng.randint(1, 2 if light else 4)
    padding = rng.choice(["none", "left", "left", "right", "holes"])
    ids, mask = _batch(rng, rows, padding, long=not light)
    new = rng.randint(1, 8 if light else 24)
    common = dict(attention_mask=mask, pad_token_id=0, do_sample=False, max_new_tokens=new)
    processors = rng.choice(["none", "none", "repetition", "ngram", "rows", "min_new"])
    if processors == "repetition":
        common["repetition_penalty"] = 1.3
    elif processors == "ngram":
        common["no_repeat_ngram_size"] = 2
    elif processors == "rows":
        common["logits_processor"] = LogitsProcessorList([RowBias()])
    elif processors == "min_new":
        common["min_new_tokens"] = rng.randint(1, 6)
    probe = model.generate(ids, **common)
    made = probe[:, ids.shape[1] :]  # stop early at tokens plain greedy makes
    stop = rng.choice(["none", "eos", "eos", "string", "user"]) if made.shape[1] > 1 else "none"
    if stop == "eos":
        common["eos_token_id"] = sorted({int(t) for t in made[:, rng.randrange(made.shape[1])]})
    elif stop == "string":
        b, j = rng.randrange(rows), rng.randrange(made.shape[1] - 1)
        common.update(tokenizer=_tokenizer(), stop_strings=["".join(_char(int(t)) for t in made[b, j : j + 2])])
    elif stop == "user":
        common["stopping_criteria"] = StoppingCriteriaList([StopsOn(int(made[rng.randrange(rows), -1]))])
    streamers = [Recorder(), Recorder()] if rng.random() < 0.3 else [None, None]
    ref = model.generate(ids, streamer=streamers[0], **common)

    settings = dict(
        bole_depth=rng.randint(1, 6),
        bole_topk=rng.randint(1, 5),
        bole_budget=rng.choice(["auto", rng.randint(1, 64)]),
        bole_verify=rng.choice(["closed_form", "closed_form", "serial"]),
        bole_attention=rng.choice(["auto", "model", "triton"]),
        bole_fuse_projections=rng.random() < 0.7,
        bole_pipeline=rng.random() < 0.7,
    )
    if settings["bole_verify"] == "closed_form":
        settings["bole_prefill"] = rng.choice(["auto", "plain", "chains"])
    drafter = rng.choice(["mtp", "ngram", "random", "random"] if kind == "dense" else ["ngram", "random", "random"])
    room = rng.choice([2, 16, plan.INITIAL_ROOM])  # small: the cache and the sequences grow inside the call
    if drafter == "random":
        P = ids.shape[1]
        real = mask.sum(-1).tolist()
        continuations = [ref[b, P:].tolist() + [0] * 8 for b in range(rows)]
        max_depth = rng.choice([None, rng.randint(1, 6)])
        drafter = RandomTreeDrafter(seed, real, continuations, max_depth, truth=rng.random())
    settings["bole_drafter"] = drafter
    described = {"seed": seed, "model": kind, "rows": rows, "padding": padding, "processors": processors, "room": room,
                 "stop": stop, "streamer": streamers[0] is not None,
                 **{k: v for k, v in common.items()
                    if k not in ("attention_mask", "logits_processor", "tokenizer", "stopping_criteria")},
                 **{k: (type(v).__name__ if k == "bole_drafter" and not isinstance(v, str) else v)
                    for k, v in settings.items()}}  # fmt: skip
    initial_room = plan.INITIAL_ROOM
    try:
        plan.INITIAL_ROOM = room
        out = model.generate(ids, custom_generate="hf_bole", streamer=streamers[1], **common, **settings)
    except ValueError as e:
        chainable = unchainable(mask.bool(), tiny.generate_positions(mask)) is None
        if settings.get("bole_prefill") == "chains" and not chainable and "bole_prefill='chains'" in str(e):
            return described, f"refused: {e}"
        raise AssertionError(f"case {described} raised: {e}") from e
    finally:
        plan.INITIAL_ROOM = initial_room
    assert torch.equal(out, ref), f"case {described}:\nhf_bole {out.tolist()}\nplain   {ref.tolist()}"
    if streamers[0] is not None:
        same = len(streamers[1].puts) == len(streamers[0].puts) and all(map(torch.equal, *(s.puts for s in streamers)))
        assert same and streamers[1].ended, f"case {described}: streamed"
    return described, "ok"


@pytest.mark.parametrize(
    "kernels, share, least",
    [
        pytest.param("torch", 1.0, 3, id="torch"),
        pytest.param("triton", 0.3, 1, marks=pytest.mark.interpreter, id="triton"),
    ],
)
def test_fuzz_matches_plain_greedy(models, kernels, share, least):
    """Random cases against plain greedy generate, for `SECONDS` seconds: through the kernels' torch references, and
    for a share of that (at least one case) through the Triton kernels under the interpreter, other and lighter
    cases."""
    start, results = time.monotonic(), []
    first = SEED + (0 if kernels == "torch" else 10**6)
    for case in range(CASES):
        if case >= least and time.monotonic() - start > share * SECONDS:
            break
        results.append(_case(first + case, models, light=kernels == "triton"))
    assert results
    # After any refused case the model still decodes: the next cases ran, and one more plain check here.
    ids, mask = _batch(random.Random(SEED), 2, "left")
    kwargs = dict(attention_mask=mask, pad_token_id=0, do_sample=False, max_new_tokens=6)
    assert torch.equal(
        models["dense"].generate(ids, custom_generate="hf_bole", bole_drafter="ngram", **kwargs),
        models["dense"].generate(ids, **kwargs),
    )
