"""The decoding loop: one round is draft -> select -> verify -> accept -> commit (DESIGN.md §3), for the whole batch.

    # 1. draft   `draft.py`   the drafter proposes a tree per row from what it has not seen yet (`Unseen`)
    # 2. select  `select.py`  the batch-shared budget keeps the best nodes by cumulative draft probability
    # 3. verify  `verify.py`  one target forward over root + kept nodes of every row, from the committed state
    # 4. accept  `accept.py`  greedy or lossless sampling acceptance walks each tree with the target's logits
    # 5. commit  `commit.py`  the cache keeps each row's accepted path; the drafter's next inputs are gathered

Each step is an object chosen once per call (`CallPlan` decides: launched from Python or replayed from CUDA graphs,
greedy or sampling, a built-in or a user's drafter), and each hands the next what it needs as a value. Rows advance
independently; the host reads every round's tokens back (`rows.py`), applies the stopping rules (`stopping.py`) and
streams (`streaming.py`), one round behind the device while rounds are pipelined. Output, stopping, padding and
streaming follow plain `generate` step for step. Before the first round the prompt enters the cache
(`prefill.py`), after the state of a cache the caller passed (`continuation.py`), and after the last round the cache
is brought to the output's tokens where it is handed back. The `generate` entry point is `entry.py`.
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig
from transformers.generation.stopping_criteria import StoppingCriteriaList

from hf_bole.cache import BoleCache
from hf_bole.generation.accept import make_accept
from hf_bole.generation.commit import Commit, GreedyTail, RowEnds
from hf_bole.generation.continuation import hand_back, load, settle
from hf_bole.generation.draft import CheckedDraft, Draft, Unseen
from hf_bole.generation.output import CACHE_FIELD, BoleGenerateOutput
from hf_bole.generation.phases import PhaseTimer
from hf_bole.generation.plan import CallPlan
from hf_bole.generation.prefill import prefill_prompt
from hf_bole.generation.rows import Queued, Rows, read_round, upload_flags
from hf_bole.generation.select import Select, graphed_select, select_round
from hf_bole.generation.streaming import Streamer
from hf_bole.generation.verify import Verify, graphed_cache
from hf_bole.generation.writes import Writes
from hf_bole.models import attention_backends


@torch.no_grad()
@attention_backends()  # SDPA without cuDNN for the whole call: it re-plans for every new key length
def decode(
    model,
    input_ids: torch.LongTensor,
    logits_processor=None,
    stopping_criteria: StoppingCriteriaList | None = None,
    generation_config: GenerationConfig | None = None,
    streamer=None,
    assistant_model=None,
    synced_gpus=None,
    **model_kwargs,
):
    """`generate`'s decoding method: transformers' prepared inputs, processors and criteria in, its output out."""
    dropped = {"assistant_model": assistant_model, "synced_gpus": synced_gpus}
    plan = CallPlan.prepare(
        model, input_ids, logits_processor, stopping_criteria, generation_config, dropped, model_kwargs
    )  # fmt: skip
    generation_config = generation_config if generation_config is not None else model.generation_config
    bole, device, B, P = plan.bole, plan.device, *plan.input_ids.shape
    cache, verify, select, graphs = _verify_and_select(model, plan)
    if plan.cached is not None:
        load(plan.cached, cache, plan.mask)
    # Chains (the prompt's, a returned cache's missing tokens) replay from the verify graphs, and so do their commits.
    chain_forward, chain_commit = (verify.forward, None) if graphs is None else (graphs, graphs.commit)
    hidden, first = prefill_prompt(model, plan, cache, chain_forward, chain_commit)

    # writes.seq: every row as plain decoding's `input_ids` holds it (`Writes`), with room for a round past `room`
    width = P + plan.room + plan.lag * plan.step + plan.per_row + 3
    graphed_writes = plan.graphed and device.type == "cuda"
    writes = Writes.for_call(model, plan.input_ids, width, plan.pad_token, plan.stopping, graphed_writes)
    state = Rows(B, P, plan.max_new, plan.stopping, writes)
    # The drafter sees the prefilled tokens' hidden states: none of a cached prefix.
    prompt_lengths = plan.mask.sum(-1)  # [B]
    unseen_prefix = prompt_lengths - plan.run.sum(-1)  # [B]
    draft_args = (plan.drafter, writes, plan.columns, prompt_lengths, unseen_prefix, P, plan.step, device)
    if plan.builtin_drafter or plan.drafter is None:
        draft = Draft(*draft_args)
    else:  # a user's drafter gets its trees checked every round
        draft = CheckedDraft(
            *draft_args, vocab_size=plan.vocab_size, max_depth=plan.max_depth, pipelined=plan.pipelined
        )  # fmt: skip
    # The drafter's next inputs keep one shape from round to round (one CUDA graph) with `max_depth`: `step` columns,
    # or the tree's width where narrower (one column after a round of the roots alone).
    unseen_width = plan.step if plan.max_depth is not None else None
    # A cache handed back holds no token past the output: commits stop at the length limit and at a row's EOS.
    ends = RowEnds(tuple(sorted(plan.stopping.eos)), generation_config.max_length - 1) if plan.returns_cache else None
    if graphs is not None and not plan.do_sample and not plan.logits_processor:
        # Greedy without processors reads nothing but the logits: acceptance and commit replay from one graph.
        tail = GreedyTail(graphs.tail, plan.step, unseen_width, ends)
        accept, commit = tail.accept, tail.commit
    else:
        accept = make_accept(plan.do_sample, plan.logits_processor, writes, P)
        commit = Commit(cache, plan.step, unseen_width, ends)

    # The first token is read like a round's tokens: pipelined, after the first round is queued (behind the prefill).
    queued = [Queued(state.write(first[:, None], torch.ones(B, dtype=torch.long, device=device)), None, round=False)]
    streamed = Streamer(streamer, state)
    while len(queued) > plan.lag:
        read_round(state, queued.pop(0), draft)
        streamed.flush()

    # What the drafter has not seen yet: the prefilled tokens' hidden states, each followed by its next token.
    next_tokens = torch.cat([plan.input_ids[:, plan.tail + 1 :], first[:, None]], dim=1)
    unseen = Unseen(hidden, next_tokens, plan.run, plan.text_positions[:, plan.tail :])
    root = first
    rounds: list[list[int]] = []  # per round, the tokens each row accepted (0: it sat the round out)
    peak_transient = {"factors": 0, "snapshots": 0, "conv_inputs": 0, "tree_kv": 0}  # the rounds' tree state
    timer = PhaseTimer(device, enabled=bole.profile)
    uploaded = None  # the `active` list `active_t` [B] holds on the device
    while True:
        active = state.active()
        if not any(active):
            if not queued:
                break
            # Rows finished in a round read after the last launch: what is still queued was not needed.
            for q in queued:
                read_round(state, q, draft)
            queued.clear()
            continue
        timer.round_start()
        if active != uploaded:  # made again only when a row finishes
            uploaded, active_t = active, upload_flags(active, device)
        # Upper bounds from the host's counts, which lag the device by the rounds still queued.
        longest = max(n for n, a in zip(state.n_gen, active) if a) + plan.step * len(queued)
        rows = sum(active)

        # The round's budget, from host-side counts: the active rows and the longest active row's KV length. It caps
        # every row's tree at its forward's width, so the drafter need draft no deeper (0: the roots alone).
        budget = plan.budget_for(rows, P - 1 + longest)
        cap = select.cap(budget, rows)
        # 1. Draft a tree per row from what the drafter has not seen yet.
        drafted = draft(unseen, state.n_gen, longest, cap)
        timer.mark("draft")
        # 2. Select the round's budget of nodes across the batch. Rows that are done verify their root only (their
        # draft gets no budget) and commit nothing.
        verify_tree = select(drafted, root, budget, cap, active_t)
        timer.mark("select")
        # 3. Verify every row's tree in one target forward from the committed state.
        verified = verify(verify_tree, rows)
        timer.mark("verify")
        peak_transient = max(peak_transient, verified.out.tree_round.transient_bytes, key=lambda t: sum(t.values()))
        # 4. Accept: walk each tree with the target's logits.
        accepted = accept(verified, state.n_gen)
        timer.mark("accept")
        # 5. Commit each row's accepted path; gather what the drafter has not seen.
        tail = commit(verified, accepted, active_t)
        timer.mark("commit")

        queued.append(Queued(state.write(tail.tokens, tail.lengths), drafted.host_copy))
        unseen, root = tail, tail.root
        # Read what the host may no longer wait for: every round but the last `lag` ones.
        while len(queued) > plan.lag:
            q = queued.pop(0)
            accepted_counts = read_round(state, q, draft)
            if q.round:
                rounds.append(accepted_counts)
            streamed.flush()
        timer.mark("host")

    T_out = state.output_length()
    streamed.flush(T_out, final=True)
    sequences = state.sequences(T_out)
    returned = None
    if plan.returns_cache:
        settle(model, cache, chain_forward, chain_commit, writes.seq, sequences, plan)
        returned = hand_back(plan.cached, cache, model.config.get_text_config(decoder=True))
    if not generation_config.return_dict_in_generate:
        return sequences
    accept_lengths = torch.tensor(rounds, dtype=torch.long, device=device).view(len(rounds), B).T
    played = (accept_lengths > 0).sum()
    mean = float(accept_lengths.sum() / played) if played > 0 else 0.0
    return BoleGenerateOutput(
        sequences=sequences,
        **{CACHE_FIELD: returned},
        accept_lengths=accept_lengths,
        mean_accepted_tokens=mean,
        peak_transient_bytes=peak_transient,
        round_time_ms=timer.totals_ms(),
        round_host_ms=timer.host_totals_ms(),
    )


def _verify_and_select(model, plan: CallPlan):
    """The call's cache and steps 2 and 3, launched from Python or replayed from CUDA graphs (`plan.graphed`), and
    the verify graphs (None without), whose tails and commits replay with them."""
    bole = plan.bole
    continued = None if plan.cached is None else plan.cached.given
    if plan.graphed:  # a cache kept across calls, whose verify forwards replay from CUDA graphs
        cache, graphs = graphed_cache(
            model, plan.input_ids.shape[0], plan.capacity, bole.verify, bole.compile, bole.fuse_projections,
            bole.attention, continued,
        )  # fmt: skip
        kept = graphed_select(model)
        return cache, graphs.step, Select(kept, plan.per_row, kept.roots_only), graphs
    cache = BoleCache.for_model(model, plan.input_ids.shape[0])  # grows on demand
    cache.reserve(plan.capacity)
    verify = Verify(model, cache, bole.verify, bole.compile, bole.fuse_projections, bole.attention, plan.pipelined)
    return cache, verify, Select(select_round, plan.per_row), None
