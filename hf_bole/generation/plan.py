"""A `generate` call's plan, made once before its first round: its settings resolved (`BoleConfig`, the request's
checks, the placement, sampling, stopping), its inputs on the loop's device, the budget rule, the drafter, how rounds
launch (CUDA graphs, pipelining) and how much room the cache and the sequences start with."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation.stopping_criteria import StoppingCriteriaList
from transformers.utils import logging

from hf_bole.config import BoleConfig, resolve_attention
from hf_bole.generation.acceptance import check_logits_processor, is_context_free
from hf_bole.generation.budget import BudgetResolver
from hf_bole.generation.continuation import Continuation, continuation, given_cache
from hf_bole.generation.draft import drafter_max_depth, make_drafter, prompt_columns
from hf_bole.generation.graphs import KEPT_CAPACITY_STEP, captures
from hf_bole.generation.prefill import unchainable, use_chains, weight_bytes
from hf_bole.generation.requests import assistant_drafter, check_request, spread_settings, tensor_parallel_settings
from hf_bole.generation.select import width_bucket
from hf_bole.generation.stopping import Stopping
from hf_bole.generation.verify import round_bytes
from hf_bole.kernels.utils import MAX_TREE_NODES
from hf_bole.models import family_of, graph_unsafe_experts
from hf_bole.placement import placement
from hf_bole.tensor_parallel import check_same_generator, tensor_parallel

logger = logging.get_logger(__name__)

# Generated tokens a call makes room for up front (the cache's slots, the sequences' columns); longer calls grow them.
# One step of the kept caches' capacities: a call of a short prompt fits the first one.
INITIAL_ROOM = KEPT_CAPACITY_STEP


@dataclass
class CallPlan:
    """What a `generate` call decided before its first round (`CallPlan.prepare`)."""

    bole: BoleConfig  # the tree settings, "auto" attention resolved
    device: torch.device  # where the loop runs: the LM head's device
    in_device: torch.device  # where the prompt goes in: the embedding's device
    input_ids: torch.Tensor  # [B, P] on `device`
    attention_mask: torch.Tensor | None  # [B, P] as given, on `in_device`
    mask: torch.Tensor  # [B, P] bool on `device`, True at the prompt's tokens
    position_ids: torch.Tensor  # [B, P] (or [4, B, P], mRoPE) on `device`
    max_new: int  # tokens to generate at most
    pad_token: int
    do_sample: bool
    logits_processor: object
    stopping: Stopping
    budget_for: BudgetResolver  # the budget of every round
    per_row: int  # the most draft nodes one row's tree keeps
    drafter: object  # None where no round drafts
    max_depth: int | None  # the drafter's, when it declares one (0 without a drafter)
    vocab_size: int
    graphed: bool  # verify forwards replay from CUDA graphs
    pipelined: bool  # round r + 1 is queued before the host reads round r
    step: int  # the most tokens one round commits per row
    room: int  # generated tokens the cache and the sequences hold before they grow
    capacity: int  # the cache's slots per row up front
    chains: bool  # the prompt enters the cache as chains through the verify forward
    cached: Continuation | None  # the caller's cache the call continues from
    tail: int  # the first column the prefill runs (0 without a cache)
    run: torch.Tensor  # [B, P - tail] bool on `device`: the tokens the prefill runs, those after each row's cached ones
    returns_cache: bool  # the cache is handed back (`return_dict_in_generate`, or the caller's updated in place)
    # Where each row's prompt sits in the sequences, for drafters that read them (None while pipelined): read here,
    # before the prefill is queued, where a read after it would wait for it.
    columns: list | None

    @property
    def builtin_drafter(self) -> bool:
        """Whether hf_bole made the drafter (MTP, n-gram, a small model's): a user's gets its trees checked."""
        return isinstance(self.bole.drafter, (str, PreTrainedModel))

    @property
    def lag(self) -> int:
        """Rounds the host may read late: 1 while pipelined."""
        return 1 if self.pipelined else 0

    @property
    def text_positions(self) -> torch.Tensor:
        """`[B, P]` the prompt's text position ids."""
        return self.position_ids[0] if self.position_ids.dim() == 3 else self.position_ids

    @classmethod
    def prepare(
        cls,
        model,
        input_ids: torch.LongTensor,
        logits_processor,
        stopping_criteria: StoppingCriteriaList | None,
        generation_config: GenerationConfig | None,
        dropped: dict,
        model_kwargs: dict,
    ) -> CallPlan:
        """The plan of `model.generate`'s call with these arguments (`dropped`: the assistant model and `synced_gpus`
        transformers does not forward), checking the request first."""
        generation_config = generation_config if generation_config is not None else model.generation_config
        assistant_drafter(dropped.get("assistant_model"), model_kwargs)
        bole, model_kwargs = BoleConfig.from_generate_kwargs(
            {k: v for k, v in model_kwargs.items() if v is not None or not k.startswith("bole_")}, generation_config
        )
        check_request(model, generation_config, model_kwargs, dropped)
        place, tp = placement(model), tensor_parallel(model)
        bole = tensor_parallel_settings(model, spread_settings(bole, place), tp, place)
        # "auto" attention, settled once for the call: the graphs, the budget table and the forwards are keyed by it.
        kernel = family_of(model.config).tree_attention_kernel
        bole = dataclasses.replace(bole, attention=resolve_attention(bole.attention, place.layer_devices[0], kernel))
        check_logits_processor(logits_processor)
        stopping = Stopping(stopping_criteria or StoppingCriteriaList(), input_ids.shape[1])
        pad_token = generation_config._pad_token_tensor
        pad_token = int(pad_token) if pad_token is not None else 0

        # The loop runs where the logits come out (the LM head's device); the prompt goes in at the embedding's, the
        # tree's parents and accepted paths to the cache's (the first layer's). All three are one device unless the
        # model is spread over several by accelerate's device_map.
        device, in_device = place.output_device, place.input_device
        input_ids = input_ids.to(device)
        B, P = input_ids.shape
        if tp.size > 1 and generation_config.do_sample:
            check_same_generator(tp, device)
        if P == 0:
            raise ValueError(
                f"hf_bole continues a prompt: input_ids has {B} rows of 0 tokens; give every row at least one token "
                f"(e.g. the tokenizer's BOS token)"
            )
        max_new = generation_config.max_length - P
        attention_mask = model_kwargs.get("attention_mask")
        if attention_mask is not None:
            attention_mask = attention_mask.to(in_device)
        if attention_mask is None:
            mask = torch.ones_like(input_ids, dtype=torch.bool)
        else:
            mask = attention_mask.to(device).bool()
        counted = (mask.long().cumsum(-1) - 1).clamp(min=0)  # [B, P] each token's place among its row's tokens
        position_ids = model_kwargs.get("position_ids")
        position_ids = counted if position_ids is None else position_ids.to(device)
        # A cache the caller passed: its tokens are not prefilled again, and it is updated in place at the end.
        given = given_cache(model_kwargs)
        if given is not None and generation_config.use_cache is False:
            raise ValueError("use_cache=False asks generate for no cache, but one was passed: drop one of the two")
        config = model.config.get_text_config(decoder=True)
        cached = None if given is None else continuation(given, config, input_ids, mask, generation_config.max_length)
        tail = 0 if cached is None else cached.first
        run = mask if cached is None else cached.uncached(mask)
        returns_cache = given is not None or (
            bool(generation_config.return_dict_in_generate) and generation_config.use_cache is not False
        )

        # The budget of each round: fixed, or looked up by active rows and KV length ("auto", generation/budget).
        budget_for = BudgetResolver.for_model(model, bole, B)
        per_row = min(MAX_TREE_NODES - 1, budget_for.max_row_nodes)  # a tree's nodes, the root not counted
        # A call whose every round verifies the roots alone (budget 0: plain decoding) makes no drafter.
        drafter = make_drafter(model, bole, device) if budget_for.drafts else None
        max_depth = drafter_max_depth(drafter) if drafter is not None else 0
        graphed = captures(model, bole.cuda_graphs)
        # Pipelined rounds (`BoleConfig.pipeline`): round r + 1 is queued before the host reads round r's tokens.
        # Every launch of a round must then need nothing from the host that round r decides: a drafter that reads no
        # host-side sequences, no processor or criterion reading ids. Rows that finished in round r draft and verify
        # once more in round r + 1 (the host does not know yet); what they commit is never read.
        pipelined = (
            bole.pipeline and max_depth is not None and is_context_free(logits_processor) and not stopping.others
        )
        step = max_depth + 1 if max_depth is not None else per_row + 1
        lag = 1 if pipelined else 0

        # Room for the first `room` generated tokens: committed slots then reach prompt + room + one round's
        # overshoot per round in flight, and the tree needs per_row + 1 more. Past it the cache and the sequences grow
        # (doubling), so that a call takes memory and time for the tokens it generates, not for max_new_tokens.
        room = min(max_new, INITIAL_ROOM)
        capacity = P + room + (1 + lag) * step + per_row + 1
        node_bytes = B * sum(round_bytes(model.config, 1, model.dtype).values())  # one node of every row
        chain_round = width_bucket(min(P - tail, MAX_TREE_NODES), MAX_TREE_NODES) * node_bytes
        chains = use_chains(bole.prefill, graphed, P - tail, bole.verify, weight_bytes(model), chain_round)
        # Rows whose shared prefix ends in different columns: transformers' forward appends the same columns to every
        # row, chains each row's own tokens.
        ragged = cached is not None and not cached.aligned
        chains = chains or (ragged and bole.prefill == "auto" and bole.verify == "closed_form")
        reason = unchainable(mask, position_ids[..., tail:], run) if chains else None
        if reason is not None and bole.prefill == "chains":
            raise ValueError(
                f"bole_prefill='chains' would not prefill this batch as transformers' forward does: {reason}; pass "
                f"bole_prefill='plain' (or 'auto', which chooses it here)"
            )
        chains = chains and reason is None
        if ragged and not chains:
            reason = reason or (
                "verify='serial' keeps a state snapshot per chain token" if bole.verify == "serial"
                else f"bole_prefill={bole.prefill!r} asks for transformers' forward"
            )  # fmt: skip
            raise ValueError(
                f"a prefix shared by rows of different left padding is prefilled as chains through the verify forward, "
                f"which this call cannot: {reason}; left-pad the rows to the same length, or pass bole_prefill='auto'"
            )
        if chains:
            capacity += MAX_TREE_NODES  # a prefill chain's tree, committed or not, takes the slots after the tokens
        if bole.cuda_graphs and device.type == "cuda" and not graphed:  # what `captures` refused, said once
            family = family_of(model.config)
            if not family.cuda_graphs:
                logger.warning_once(
                    f"hf_bole: CUDA graphs cannot capture a {family.name} forward: its indexer reads the device back "
                    f"mid-forward. Its verify forwards run without graphs, launched from Python; "
                    f"bole_cuda_graphs=False says the same without this warning"
                )
            elif unsafe := graph_unsafe_experts(model):
                logger.warning_once(
                    f"hf_bole: CUDA graphs cannot capture the model's mixture-of-experts layers ({unsafe[0]}, ...): "
                    f"eager experts route tokens on the host, and torch's grouped_mm does outside bf16. Its verify "
                    f"forwards run without graphs, launched from Python. To replay them from graphs load the model in "
                    f"bf16 with experts_implementation='grouped_mm' (transformers' default), or call "
                    f"model.set_experts_implementation('batched_mm'); bole_cuda_graphs=False says the same without "
                    f"this warning"
                )
        return cls(
            bole=bole, device=device, in_device=in_device, input_ids=input_ids, attention_mask=attention_mask,
            mask=mask, position_ids=position_ids, max_new=max_new, pad_token=pad_token,
            do_sample=bool(generation_config.do_sample), logits_processor=logits_processor, stopping=stopping,
            budget_for=budget_for, per_row=per_row, drafter=drafter, max_depth=max_depth,
            vocab_size=model.get_output_embeddings().weight.shape[0], graphed=graphed, pipelined=pipelined, step=step,
            room=room, capacity=capacity, chains=chains, cached=cached, tail=tail, run=run,
            returns_cache=returns_cache, columns=None if pipelined else prompt_columns(mask),
        )  # fmt: skip
