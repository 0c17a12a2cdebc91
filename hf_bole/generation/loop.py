"""The decoding loop: draft -> select -> verify -> accept -> commit, behind transformers' `custom_generate`.

    model.generate(input_ids, custom_generate="hf_bole")            after `import hf_bole`
    model.generate(input_ids, custom_generate=hf_bole.generate)     the callable form
    model.generate(input_ids, custom_generate="<repo with custom_generate/>", trust_remote_code=True)

One round (DESIGN.md §3) for the whole batch: the drafter proposes a tree per row; the batch-shared budget keeps
the best nodes by cumulative draft probability; one target forward verifies root + kept nodes of every row from
the committed state; greedy or lossless sampling acceptance walks each tree; the cache commits each row's
accepted path. Rows advance independently; output, stopping, padding and streaming follow plain `generate`
step for step. Before the first round the prompt enters the cache: through the verify forward as chains
(`generation/prefill.py`) or through transformers' forward over it.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from transformers import GenerationConfig
from transformers.generation.stopping_criteria import StoppingCriteriaList
from transformers.utils import logging

from hf_bole.cache import BoleCache
from hf_bole.config import BoleConfig, resolve_attention
from hf_bole.generation.accept_kernel import accept_greedy_kernel
from hf_bole.generation.acceptance import (
    accept_sampling,
    check_logits_processor,
    is_context_free,
    process_logits,
    sample_tokens,
)
from hf_bole.generation.budget import BudgetResolver
from hf_bole.generation.draft import check_custom_tree, drafter_max_depth, make_drafter
from hf_bole.generation.drafters import DraftContext
from hf_bole.generation.graphs import CAPACITY_STEP, captures, graphed_cache, graphed_select, row_width, trimmed
from hf_bole.generation.output import BoleGenerateOutput
from hf_bole.generation.phases import PhaseTimer
from hf_bole.generation.prefill import chain_prefill, unchainable, use_chains, weight_bytes
from hf_bole.generation.requests import check_request, spread_settings
from hf_bole.generation.rows import Queued, Rows, prompt_columns, read_round, row_sequences, upload_flags
from hf_bole.generation.select_kernel import select_round
from hf_bole.generation.stopping import Stopping
from hf_bole.generation.streaming import Streamer
from hf_bole.generation.tail import round_tail
from hf_bole.generation.tree import DraftTree
from hf_bole.generation.writes import Writes
from hf_bole.kernels.tree_gdn.closed_form import MAX_NODES
from hf_bole.models import attention_backends, cache_argument, graph_unsafe_experts, tree_forward
from hf_bole.placement import placement

logger = logging.get_logger(__name__)

# Generated tokens a call makes room for up front (the cache's slots, the sequences' columns); longer calls grow them.
INITIAL_ROOM = CAPACITY_STEP

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
    generation_config = generation_config if generation_config is not None else model.generation_config
    bole, model_kwargs = BoleConfig.from_generate_kwargs(
        {k: v for k, v in model_kwargs.items() if v is not None or not k.startswith("bole_")}, generation_config
    )
    check_request(model, generation_config, model_kwargs, {"assistant_model": assistant_model, "synced_gpus": synced_gpus})
    place = placement(model)
    bole = spread_settings(bole, place)
    # "auto" attention, settled once for the call: the graphs, the budget table and the forwards are keyed by it.
    bole = dataclasses.replace(bole, attention=resolve_attention(bole.attention, place.layer_devices[0]))
    check_logits_processor(logits_processor)
    stopping = Stopping(stopping_criteria or StoppingCriteriaList(), input_ids.shape[1])
    do_sample = bool(generation_config.do_sample)
    pad_token = generation_config._pad_token_tensor
    pad_token = int(pad_token) if pad_token is not None else 0

    # The loop runs where the logits come out (the LM head's device); the prompt goes in at the embedding's, the
    # tree's parents and accepted paths to the cache's (the first layer's). All three are one device unless the
    # model is spread over several by accelerate's device_map.
    device, in_device = place.output_device, place.input_device
    input_ids = input_ids.to(device)
    B, P = input_ids.shape
    if P == 0:
        raise ValueError(
            f"hf_bole continues a prompt: input_ids has {B} rows of 0 tokens; give every row at least one token "
            f"(e.g. the tokenizer's BOS token)"
        )
    max_new = generation_config.max_length - P
    attention_mask = model_kwargs.get("attention_mask")
    if attention_mask is not None:
        attention_mask = attention_mask.to(in_device)
    mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.to(device).bool()
    counted = (mask.long().cumsum(-1) - 1).clamp(min=0)  # [B, P] each token's place among its row's tokens
    position_ids = model_kwargs.get("position_ids")
    position_ids = counted if position_ids is None else position_ids.to(device)
    text_positions = position_ids[0] if position_ids.dim() == 3 else position_ids

    row_cap = MAX_NODES - 1  # the kernels verify at most MAX_NODES nodes per tree, the root included
    # The budget of each round: fixed, or looked up by active rows and KV length ("auto", generation/budget.py).
    budget_for = BudgetResolver.for_model(model, bole, B)
    per_row = max(1, min(row_cap, budget_for.max_budget))
    drafter = make_drafter(model, bole, device)
    builtin_drafter = isinstance(bole.drafter, str)  # a user's drafter gets its trees checked every round
    max_depth = drafter_max_depth(drafter)
    vocab_size = model.get_output_embeddings().weight.shape[0]
    graphed = captures(model, bole.cuda_graphs)
    # Pipelined rounds (`BoleConfig.pipeline`): round r + 1 is queued before the host reads round r's tokens. Every
    # launch of a round must then need nothing from the host that round r decides: a drafter that reads no host-side
    # sequences, no processor or criterion reading ids. Rows that finished in round r draft and verify once more in
    # round r + 1 (the host does not know yet); what they commit is never read.
    pipelined = bole.pipeline and max_depth is not None and is_context_free(logits_processor) and not stopping.others
    # The most tokens one round commits per row (its accepted path), and how many rounds the host may lag behind.
    step = max_depth + 1 if max_depth is not None else per_row + 1
    lag = 1 if pipelined else 0

    # Room for the first `room` generated tokens: committed slots then reach prompt + room + one round's overshoot
    # per round in flight, and the tree needs per_row + 1 more. Past it the cache and the sequences grow (doubling),
    # so that a call takes memory and time for the tokens it generates, not for max_new_tokens.
    room = min(max_new, INITIAL_ROOM)
    capacity = P + room + (1 + lag) * step + per_row + 1
    chains = use_chains(bole.prefill, graphed, P, bole.verify, weight_bytes(model))
    reason = unchainable(mask, position_ids) if chains else None
    if reason is not None and bole.prefill == "chains":
        raise ValueError(
            f"bole_prefill='chains' would not prefill this batch as transformers' forward does: {reason}; pass "
            f"bole_prefill='plain' (or 'auto', which chooses it here)"
        )
    chains = chains and reason is None
    # Read before the prefill is queued, not after: a read then would wait for it.
    columns = None if pipelined else prompt_columns(mask)
    if chains:
        capacity += MAX_NODES  # a prefill chain's tree, committed or not, takes the slots after the tokens before it
    if bole.cuda_graphs and device.type == "cuda" and not graphed:  # captures() refuses some experts
        logger.warning_once(
            f"hf_bole: CUDA graphs cannot capture the model's mixture-of-experts layers "
            f"({graph_unsafe_experts(model)[0]}, ...): eager experts route tokens on the host, and torch's grouped_mm "
            f"does outside bf16. Its verify forwards run without graphs, launched from Python. To replay them from "
            f"graphs load the model in bf16 with experts_implementation='grouped_mm' (transformers' default), or "
            f"call model.set_experts_implementation('batched_mm'); bole_cuda_graphs=False says the same without this "
            f"warning"
        )
    if graphed:  # a cache kept across calls, whose verify forwards replay from CUDA graphs (generation/graphs.py)
        cache, verify_forward = graphed_cache(
            model, B, capacity, bole.verify, bole.compile, bole.fuse_projections, bole.attention
        )
        select = graphed_select(model)
        # Greedy without processors reads nothing but the logits: the round's tail replays from a graph too.
        tails = verify_forward.tail if not do_sample and not logits_processor else None
    else:
        cache = BoleCache.for_model(model, B)  # grows on demand
        cache.reserve(capacity)
        verify_forward = functools.partial(
            tree_forward, model, cache, verify=bole.verify, compile=bole.compile,
            fuse_projections=bole.fuse_projections, attention=bole.attention,
        )  # fmt: skip
        select = select_round
        tails = None
    if chains:  # the prompt through the verify forward (generation/prefill.py)
        commit = verify_forward.commit if graphed else None  # replayed from graphs with the verify forwards
        hidden = chain_prefill(verify_forward, cache, input_ids, mask, pad_token, commit).to(device)  # [B, P, hidden]
    else:
        decoder = model.get_decoder()
        prefill = decoder(
            input_ids=input_ids.to(in_device),
            attention_mask=attention_mask,
            position_ids=position_ids.to(in_device),
            use_cache=True,
            **{cache_argument(type(decoder).forward): cache},
        )
        hidden = prefill.last_hidden_state.to(device)  # [B, P, hidden]
    logits = model.get_output_embeddings()(hidden[:, -1]).float()  # [B, V]
    scores = logits_processor(input_ids, logits) if logits_processor else logits
    first = sample_tokens(scores) if do_sample else scores.argmax(-1)  # [B]

    # writes.seq: every row as plain decoding's `input_ids` holds it (`Writes`), with room for a round past `room`
    writes = Writes.for_call(
        model, input_ids, P + room + lag * step + per_row + 3, pad_token, stopping, graphed and device.type == "cuda"
    )
    prompt_lengths = mask.sum(-1)  # [B] on the device
    state = Rows(B, P, max_new, stopping, writes)
    # The first token is read like a round's tokens: pipelined, after the first round is queued (behind the prefill).
    queued = [Queued(state.write(first[:, None], torch.ones(B, dtype=torch.long, device=device)), None, round=False)]
    streamed = Streamer(streamer, state)
    while len(queued) > lag:
        read_round(state, queued.pop(0), drafter, max_depth, vocab_size)
        streamed.flush()

    # What the drafter has not seen yet: the prompt's hidden states, each followed by its next token.
    new_hidden = hidden
    new_tokens = torch.cat([input_ids[:, 1:], first[:, None]], dim=1)
    new_mask, new_positions = mask, text_positions
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
                read_round(state, q, drafter, max_depth, vocab_size)
            queued.clear()
            continue
        timer.round_start()
        if active != uploaded:  # made again only when a row finishes
            uploaded, active_t = active, upload_flags(active, device)
        # Upper bounds from the host's counts, which lag the device by the rounds still queued.
        longest = max(n for n, a in zip(state.n_gen, active) if a) + step * len(queued)
        ctx = DraftContext(
            sequences=None if pipelined else row_sequences(writes.seq, columns, P, state.n_gen),
            max_nodes=per_row,
            hidden_states=new_hidden,
            next_tokens=new_tokens,
            new_mask=new_mask,
            positions=new_positions,
            lengths=prompt_lengths + state.generated,
            max_length=P + longest + step,
        )
        tree = drafter.propose(ctx)
        timer.mark("draft")
        tree_copy, safe = None, None
        if not builtin_drafter:
            if pipelined:  # checked a round late on a host copy; verified now in a form no kernel can trip over
                check_custom_tree(tree, B, vocab_size, drafter, max_depth, values=False)
                tree_copy = DraftTree(*(x.to("cpu", non_blocking=True) for x in (tree.tokens, tree.parents, tree.draft_logprobs)))
                safe = (vocab_size, max_depth)  # made safe inside selection (its graph, where one replays it)
            else:
                check_custom_tree(tree, B, vocab_size, drafter, max_depth)
        tree = DraftTree(*(x.to(device) for x in (tree.tokens, tree.parents, tree.draft_logprobs)))
        # Rows that are done verify their root only (their draft gets no budget, `active_t`) and commit nothing. The
        # committed KV of the longest active row (left padding included), from host-side counts: no device read.
        rows = sum(active)
        budget = budget_for(rows, P - 1 + longest)
        # Each row keeps at most what its forward's width holds, chosen from the budget (`row_width`), not read back.
        verify = select(tree, root, budget, row_width(budget, rows, per_row + 1) - 1, active_t, safe)
        budget_for.observe(verify)  # the goodput rule's draft probabilities (selection ranked them), read next round
        if not graphed and (rows > 1 or not pipelined):
            # Launched from Python, the forward may run at the widest row's exact width; the read that takes waits for
            # drafting and selection, which a pipelined round of one row skips.
            verify = trimmed(verify)
        timer.mark("select")
        out = verify_forward(verify.input_ids, verify.parents.to(cache.device))
        timer.mark("verify")
        peak_transient = max(peak_transient, out.tree_round.transient_bytes, key=lambda t: sum(t.values()))
        # The drafter's next inputs keep one shape from round to round (one CUDA graph) with `max_depth`: `step`
        # columns.
        width = step if max_depth is not None else None
        if tails is not None:  # acceptance, commit and the drafter's next inputs: one replay (`TailGraphs`)
            tail = tails(verify, out, active_t, step, width)
            timer.mark("accept")
            timer.mark("commit")
        else:
            contexts = None
            if not is_context_free(logits_processor):
                contexts = [writes.seq[b, : P + state.n_gen[b]] for b in range(B)]
            if do_sample:
                accepted = accept_sampling(verify, process_logits(logits_processor, out.logits, verify, contexts))
            else:
                # Greedy reads only the argmax, which the processors' fp32 copy of the logits would not move: without
                # processors it is taken on the logits themselves (a [B, T, V] copy saved: 32 MB a round at batch 1
                # on the 9B shape's 32 nodes).
                scores = process_logits(logits_processor, out.logits, verify, contexts) if logits_processor else out.logits
                accepted = accept_greedy_kernel(verify, scores.argmax(-1))
            timer.mark("accept")
            tail = round_tail(cache, out, accepted, active_t, step, width)
            timer.mark("commit")

        queued.append(Queued(state.write(tail.tokens, tail.lengths), tree_copy))
        new_hidden, new_tokens, new_mask, new_positions = tail.hidden, tail.next_tokens, tail.mask, tail.positions
        root = tail.root
        # Read what the host may no longer wait for: every round but the last `lag` ones.
        while len(queued) > lag:
            q = queued.pop(0)
            accepted_counts = read_round(state, q, drafter, max_depth, vocab_size)
            if q.round:
                rounds.append(accepted_counts)
            streamed.flush()
        timer.mark("host")

    T_out = state.output_length()
    streamed.flush(T_out, final=True)
    sequences = state.sequences(T_out)
    if not generation_config.return_dict_in_generate:
        return sequences
    accept_lengths = torch.tensor(rounds, dtype=torch.long, device=device).view(len(rounds), B).T
    played = (accept_lengths > 0).sum()
    mean = float(accept_lengths.sum() / played) if played > 0 else 0.0
    return BoleGenerateOutput(
        sequences=sequences,
        past_key_values=cache,
        accept_lengths=accept_lengths,
        mean_accepted_tokens=mean,
        peak_transient_bytes=peak_transient,
        round_time_ms=timer.totals_ms(),
        round_host_ms=timer.host_totals_ms(),
    )
