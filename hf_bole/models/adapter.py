"""The narrow adapter that routes a GDN model's layers into tree mode, on transformers' own classes.

Tree mode is asked for per call: `tree_forward` passes a `bole_tree` keyword argument, which the model's
forward hands untouched to every layer, and a dict attention mask, which the model passes through untouched.
Without them every layer runs exactly as upstream. The seams, all module-level functions of the modeling module of
every supported family (`hf_bole/models/family.py`: Qwen3.5, Qwen3-Next, OLMo-Hybrid, Lara-Mini, Kimi-Linear,
Bailing-Hybrid, Qwen4-Exp, GLM-5-Next), wrapped once per process and passing through unless asked:

    causal_conv1d_fn                   the GDN conv (a hub-kernel seam): with `bole_tree`, the conv along each
                                       node's ancestor path (`tree_causal_conv1d`)
    torch_chunk_gated_delta_rule,      the GDN recurrences (hub-kernel seams): with `bole_tree`, the closed-form
    torch_recurrent_gated_delta_rule   verification from the committed state (`tree_gdn_verify`), or the serial
                                       walk; they return a `GDNTreeState` where a new state would go, which the
                                       layer hands to `BoleCache.update_recurrent_state`
    chunk_kimi_delta_attention,        the KDA recurrences of Kimi-Linear, Bailing-Hybrid and GLM-5-Next (hub-kernel
    recurrent_kimi_delta_attention     seams), the same way with `tree_kda_verify` (a log-decay per key channel)
    create_recurrent_attention_mask    called once per plain forward with the 2D attention mask and the position
                                       ids: tells a BoleCache which new slots are padding and which position
                                       comes next (nothing else in a forward shows the cache those)
    ALL_ATTENTION_FUNCTIONS            the full-attention layers' attention functions: with `bole_tree` and
                                       `attention="triton"`, hf_bole's tree attention kernel
                                       (`kernels/attention.py`) in place of the model's own

and the forward of a pooled indexer's class (`Family.pooled_indexer`, GLM-5-Next's DSA indexer): given a BoleCache,
it reads the cache through `_IndexerView`, which in a tree forward hands it each node's own sequence; and the two
windows of a per-layer embedding (`Family.per_layer_embeddings`, Qwen4-Exp's PLE), which in a tree forward read each
node's own path: the n-gram hash's forward (the tokens before the node) and the layer's dilated conv.

By default full-attention layers run the model's own attention: the ancestor mask arrives as the attention mask,
the tree positions as position ids, and `BoleCache.update` writes the tree's KV and returns the storage the mask
indexes. The MLA layers of Kimi-Linear and Bailing-Hybrid always do (`Family.tree_attention_kernel`): they cache
compressed latents and expand them to heads of two sizes after the cache, which `kernels.tree_attention` does not take.
So do Qwen4-Exp's and GLM-5-Next's indexed layers, whose indexers narrow the mask to the tokens they keep.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import weakref
from dataclasses import dataclass, field
from types import ModuleType

import torch
import transformers
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers.utils import logging

from hf_bole.cache.bole_cache import BoleCache, GDNTreeState, TreeRound
from hf_bole.config import VERIFY_MODES, resolve_attention
from hf_bole import kernels
from hf_bole.kernels import ops as kernel_ops
from hf_bole.models.family import GDN_LAYER, Family, all_families, family_of, supported
from hf_bole.models.rotary import rotary_fused
from hf_bole.models.twin import tree_twin

logger = logging.get_logger(__name__)

# The tree mask is an arbitrary ancestor pattern, which these attention implementations take as a 4D mask.
TREE_ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")


# cuDNN's SDPA backend builds an execution plan for every new key length, and decoding changes the key length every
# step. On one H200 (torch 2.11, cu130) a one-token forward of the house model took 45 ms with it (32 ms of them
# in cuDNN's planning, on the host) and 15 ms without; a tree forward 19 ms and 10 ms.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@contextlib.contextmanager
def attention_backends():
    """A context in which SDPA chooses among `SDPA_BACKENDS` (not cuDNN): hf_bole's generate, warm-up and
    calibration run inside it; outside it the user's settings stand.

    torch keeps the choice in process-wide flags, so it holds for every thread while any thread is inside: the first
    to enter saves the flags and the last to leave puts them back (each thread saving and restoring its own would
    leave cuDNN off for good after two overlapping calls whose first one ended first)."""
    global _BACKEND_USERS, _BACKEND_CONTEXT
    with _BACKEND_LOCK:
        if _BACKEND_USERS == 0:
            _BACKEND_CONTEXT = sdpa_kernel(SDPA_BACKENDS)
            _BACKEND_CONTEXT.__enter__()
        _BACKEND_USERS += 1
    try:
        yield
    finally:
        with _BACKEND_LOCK:
            _BACKEND_USERS -= 1
            if _BACKEND_USERS == 0:
                _BACKEND_CONTEXT.__exit__(None, None, None)
                _BACKEND_CONTEXT = None


_BACKEND_LOCK = threading.Lock()
_BACKEND_USERS = 0  # threads' contexts inside `attention_backends` now
_BACKEND_CONTEXT = None  # the `sdpa_kernel` context the first of them entered


@dataclass
class TreeBatch:
    """The `bole_tree` keyword argument: what the GDN seams need to verify a tree.

    Args:
        parents: `[B, N]` int64 parent of every node (-1 for roots and padding nodes).
        verify: "closed_form" or "serial".
        ancestors: `[B, N, N]` bool ancestor-or-self mask of the trees, built once for all layers.
        key_heads: the linear layers' query/key heads (`BoleCache.layout.linear_key_heads`).
        attention: "model" or "triton" (`resolve_attention`'s answer, never "auto").
        lengths: `[B]` int64 committed slots of every row (`BoleCache.lengths`), for `attention="triton"`.
        valid: `[B, C]` bool, False at the cache's padding slots (`BoleCache.valid`), for `attention="triton"`.
    """

    parents: torch.Tensor
    verify: str
    ancestors: torch.Tensor
    key_heads: int
    attention: str = "model"
    lengths: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    _copies: dict[torch.device, TreeBatch] = field(default_factory=dict, init=False, repr=False, compare=False)

    def on(self, device: torch.device) -> TreeBatch:
        """This tree on `device`: for the layers of a model spread over devices (accelerate's `device_map`), which
        would otherwise each copy parents and ancestors; made once per device and round, kept for the next layer."""
        if device == self.parents.device:
            return self
        if device not in self._copies:
            self._copies[device] = TreeBatch(
                self.parents.to(device),
                self.verify,
                self.ancestors.to(device),
                self.key_heads,
                self.attention,
                *(x if x is None else x.to(device) for x in (self.lengths, self.valid)),
            )
        return self._copies[device]


@dataclass
class TreeForwardOutput:
    """
    Output of `tree_forward`.

    Args:
        logits (`torch.FloatTensor` of shape `(batch_size, N, vocab_size)`):
            The model's logits at every node (same dtype as the model's logits), i.e. its prediction of the
            token after that node.
        hidden_states (`torch.FloatTensor` of shape `(batch_size, N, hidden_size)`):
            The final-norm output at every node (the input of `lm_head`), e.g. for an MTP drafter.
        tree_round (`TreeRound`):
            The tree's state the forward left (GDN factors or snapshots, pre-conv inputs, the KV slots it wrote):
            what `BoleCache.commit(tree_round, path)` keeps of the accepted path.
    """

    logits: torch.Tensor
    hidden_states: torch.Tensor
    tree_round: TreeRound


# transformers' experts implementations that keep shapes fixed: every token's top-k experts in one grouped or
# batched matmul. "eager" loops in Python over the experts that received tokens (a host read, data-dependent
# shapes); others (kernels from the Hub) are not known to be capturable. torch's grouped_mm runs bf16 natively; in
# other dtypes it falls back to a loop over experts that reads the routing offsets on the host (a copy that a CUDA
# graph refuses: "Cannot copy between CPU and CUDA tensors during CUDA graph capture", seen on an H200, float32).
GRAPH_SAFE_EXPERTS = ("grouped_mm", "batched_mm")


# module -> its experts blocks as (name, module): walking a model's modules costs 0.1-0.7 ms of host a `generate` call
# (the house model to the 35B-A3B shape), and blocks are not added or removed after loading. Their implementation
# and dtype can change (`set_experts_implementation`, `.to(dtype)`): those are read every call.
_EXPERTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _experts(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    if module not in _EXPERTS:
        _EXPERTS[module] = [(name, m) for name, m in module.named_modules() if name.endswith("experts")]
    return _EXPERTS[module]


def graph_unsafe_experts(module: torch.nn.Module) -> list[str]:
    """The mixture-of-experts blocks of `module` that a CUDA graph cannot capture, each as "name (why)": an experts
    implementation (`config._experts_implementation`, set by `from_pretrained(..., experts_implementation=...)` or
    `set_experts_implementation`) other than `GRAPH_SAFE_EXPERTS`, or "grouped_mm" with weights other than bf16.
    Empty for dense models."""
    unsafe = []
    for name, m in _experts(module):
        implementation = getattr(getattr(m, "config", None), "_experts_implementation", None)
        dtype = next(m.parameters()).dtype
        if implementation not in GRAPH_SAFE_EXPERTS:
            unsafe.append(f"{name} (experts_implementation={implementation!r})")
        elif implementation == "grouped_mm" and dtype != torch.bfloat16:
            unsafe.append(f"{name} (experts_implementation='grouped_mm' with {str(dtype).removeprefix('torch.')} weights)")
    return unsafe


def check_supported_model(model: torch.nn.Module) -> Family:
    """Raises a `ValueError` unless `model` is a model hf_bole can verify trees with: one of the classes of a
    supported family (`hf_bole.models.family`), with GDN and KV-caching attention layers, and an attention
    implementation that takes an arbitrary 4D mask ("sdpa" or "eager").
    Returns its family."""
    config = model.config.get_text_config(decoder=True)
    family = family_of(config)
    if not isinstance(model, family.model_classes()):
        raise ValueError(f"hf_bole verifies trees on {supported()} (text-only input); got {type(model).__name__}")
    layer_types = set(config.layer_types)
    if GDN_LAYER not in layer_types or not layer_types & set(family.attention_layers) or not layer_types <= {
        GDN_LAYER, *family.attention_layers
    }:
        raise ValueError(
            f"hf_bole needs a hybrid model of GDN ('{GDN_LAYER}') and attention ({', '.join(family.attention_layers)}) "
            f"layers, at least one of each; {type(model).__name__} has layer types {sorted(layer_types)}"
        )
    if config._attn_implementation not in TREE_ATTENTION_IMPLEMENTATIONS:
        raise ValueError(
            f"tree verification passes an ancestor mask, which attn_implementation="
            f"{config._attn_implementation!r} cannot take; load the model with attn_implementation='sdpa' "
            f"(or 'eager')"
        )
    return family


def install_adapters() -> None:
    """Wraps the tree seams of the modeling modules of every family this transformers version ships (once per
    process): `import hf_bole` does, before any `BoleCache` meets a forward, whose plain forwards report padding and
    positions through one of them."""
    for family in all_families():
        if family.available:
            for model_type in family.modules:
                _install(family.module(model_type), family)


def install_adapter(config) -> None:
    """Wraps the tree seams of the modeling module of `config` (a text config; once per process).

    Raises a `ValueError` listing the supported families and classes for any other architecture.
    """
    family = family_of(config)
    _install(family.module(config.model_type), family)


def _install(module: ModuleType, family: Family) -> None:
    _wrap(module, "causal_conv1d_fn", _tree_causal_conv1d_fn)
    if family.kda:
        _wrap(module, "chunk_kimi_delta_attention", _tree_kimi_delta_attention)
        _wrap(module, "recurrent_kimi_delta_attention", _tree_kimi_delta_attention)
    else:
        _wrap(module, "torch_chunk_gated_delta_rule", _tree_gated_delta_rule)
        _wrap(module, "torch_recurrent_gated_delta_rule", _tree_gated_delta_rule)
    _wrap(module, "create_recurrent_attention_mask", _observed_recurrent_attention_mask)
    _wrap(module, "ALL_ATTENTION_FUNCTIONS", _TreeAttentionFunctions)
    if family.pooled_indexer is not None:
        _wrap(getattr(module, family.pooled_indexer), "forward", _tree_pooled_indexer)
    if family.per_layer_embeddings is not None:
        ngram, layer = family.per_layer_embeddings
        _wrap(getattr(module, ngram), "forward", _tree_ngram_embedding)
        _wrap(getattr(module, layer), "_short_conv", _tree_ple_conv)


@torch.no_grad()
def tree_forward(
    model: torch.nn.Module,
    cache: BoleCache,
    input_ids: torch.LongTensor,
    parents: torch.LongTensor,
    verify: str = "closed_form",
    compile: bool = False,
    fuse_projections: bool = True,
    attention: str = "auto",
    tree_round: TreeRound | None = None,
) -> TreeForwardOutput:
    """Runs the model over a draft tree per row in one forward, from the committed state of `cache`.

    Every node gets exactly the logits the model gives it when the node's root-to-node path is decoded token
    by token from the committed state. The committed state is not modified; `cache.commit(out.tree_round, path)`
    then keeps each row's accepted path.

    Args:
        model: a model of a supported family (see `check_supported_model`).
        cache: the `BoleCache` the model was prefilled with.
        input_ids: `[B, N]` int64 tokens of the nodes. Node 0 of each row is its root: the last accepted token,
            not yet in the cache.
        parents: `[B, N]` int64, `parents[:, 0] = -1` and `0 <= parents[b, i] < i` otherwise; rows of a ragged
            batch are padded with extra nodes of parent -1, whose outputs are meaningless.
        verify: "closed_form" (GDN layers keep per-node factors; the default) or "serial" (node by node with a
            state snapshot per node: the SGLang-Tree baseline).
        compile: run the decoder through `torch.compile` (compiled once per decoder, into one graph: hf_bole's
            tree kernels are opaque ops in it, the norms, gates and projections around them are fused). Eager,
            the model's RMSNorms and rotary embeddings run as one kernel each instead (`models/norms.py`,
            `models/rotary.py`).
        fuse_projections: run the projections of a layer that read one input as one GEMM (`models/fused.py`):
            its first call makes their weights views of one buffer per layer, which the plain forward computes
            with exactly as before.
        attention: how the full-attention layers attend (`ATTENTION_MODES`): "model" (the model's own
            implementation, SDPA or eager, with the tree's 4D mask), "triton" (`hf_bole.kernels.tree_attention`:
            Triton on CUDA, its torch reference on the CPU) or "auto" ("triton" on CUDA, `resolve_attention`; "model"
            for a family whose attention the kernel cannot take, `Family.tree_attention_kernel`: MLA).
        tree_round: the buffers of an earlier forward's `TreeForwardOutput.tree_round` to fill again, where they fit
            this tree's shape and `verify` (`BoleCache.round_for`); new ones otherwise.

    Returns:
        `TreeForwardOutput` with `logits [B, N, vocab]` and `hidden_states [B, N, hidden]`, both on the LM head's
        device (for a model spread over devices by accelerate's `device_map`, where the logits come out; `parents`
        go on the cache's device, the first layer's), and the `tree_round` to commit from.

    Example:
        >>> cache = BoleCache(model.config, batch_size=1, dtype=model.dtype)
        >>> _ = model(prompt_ids, past_key_values=cache)  # prefill all but the last prompt token
        >>> ids = torch.tensor([[last_token, 11, 12, 13]])
        >>> parents = torch.tensor([[-1, 0, 0, 1]])  # root, two children, a grandchild under node 1
        >>> out = tree_forward(model, cache, ids, parents)
        >>> cache.commit(out.tree_round, torch.tensor([[0, 1, 3]]))  # accept root -> 1 -> 3
    """
    family = check_supported_model(model)
    if not isinstance(cache, BoleCache):
        raise ValueError(f"tree_forward needs a BoleCache, got {type(cache).__name__}")
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
    attention = resolve_attention(attention, cache.lengths.device, family.tree_attention_kernel)
    if input_ids.dim() != 2 or input_ids.shape != parents.shape:
        raise ValueError(
            f"input_ids and parents must both be [B, N], got {tuple(input_ids.shape)} and {tuple(parents.shape)}"
        )
    num_nodes = input_ids.shape[1]
    if num_nodes < family.min_tree_nodes:
        # A padding node (parent -1, the root's token) per missing one: it sees only the committed state and itself,
        # never influences a real node, and its outputs are dropped below.
        pad = family.min_tree_nodes - num_nodes
        input_ids = torch.cat([input_ids, input_ids[:, :1].expand(-1, pad)], dim=1)
        parents = torch.cat([parents, parents.new_full((parents.shape[0], pad), -1)], dim=1)
    decoder = model.get_decoder()
    config = decoder.config
    install_adapter(config)
    if len(cache.layers) != config.num_hidden_layers:
        raise ValueError(
            f"the BoleCache has {len(cache.layers)} layers but the model {config.num_hidden_layers}; build the cache "
            f"from this model's config"
        )
    if compile:
        # A tree cut to the width its forward runs at (the loop's selection pads rows) is a view with the uncut
        # strides; the compiled forward guards on strides and would compile once more for it.
        input_ids, parents = input_ids.contiguous(), parents.contiguous()
    # The decoder's twin with fused projections and norms (`models/twin.py`): the model's own modules are never
    # swapped, so a plain forward in another thread computes what it always does. Compiled, inductor fuses each norm
    # and rotary embedding with its neighbours; eager, each runs as one kernel (`models/norms.py`, `models/rotary.py`).
    twin = tree_twin(decoder, projections=fuse_projections, norms=not compile)
    forward = _compiled(twin.module) if compile else twin.module
    rotary = contextlib.nullcontext() if compile else rotary_fused()
    # One ancestor mask for every layer: the attention mask, the positions and the tree kernels share it.
    tree_round = cache.round_for(parents, verify, tree_round)
    with twin.entered(), rotary, cache.tree_mode(parents, tree_round) as (mask, position_ids, ancestors):
        masks = {layer_type: mask for layer_type in family.attention_layers}
        if "sliding_attention" in masks:
            masks["sliding_attention"] = _sliding(mask, cache, position_ids, config.sliding_window)
        if config._attn_implementation == "eager":  # eager attention adds its mask
            dtype = decoder.get_input_embeddings().weight.dtype
            zero, low = torch.zeros((), dtype=dtype, device=mask.device), torch.finfo(dtype).min
            masks = {layer_type: torch.where(m, zero, low) for layer_type, m in masks.items()}
        outputs = forward(
            input_ids=input_ids,
            attention_mask={**masks, GDN_LAYER: None},
            position_ids=family.position_ids(position_ids),
            **{cache_argument(type(decoder).forward): cache},
            use_cache=True,
            bole_tree=TreeBatch(
                parents=parents,
                verify=verify,
                ancestors=ancestors,
                key_heads=cache.layout.linear_key_heads,
                attention=attention,
                lengths=cache.lengths if attention == "triton" else None,
                valid=cache.valid if attention == "triton" else None,
            ),
        )
    hidden_states = outputs.last_hidden_state[:, :num_nodes]
    logits = model.get_output_embeddings()(hidden_states)
    # Under a device_map the final norm and the LM head may sit on different devices: hand both out where the logits
    # are (no copy on one device).
    return TreeForwardOutput(logits=logits, hidden_states=hidden_states.to(logits.device), tree_round=tree_round)


def _sliding(mask: torch.Tensor, cache: BoleCache, position_ids: torch.Tensor, window: int) -> torch.Tensor:
    """The tree mask `mask [B, 1, N, C]` of a sliding-window layer: what decoding each node's path token by token sees,
    the keys of the last `window` slots up to the node's own. A node of depth d decodes at slot `lengths[b] + d`, and
    so did each of its ancestors at its own depth (`position_ids [B, N]` are the positions after the committed ones
    plus the depths)."""
    B, _, N, C = mask.shape
    depth = position_ids - cache.positions[:, None]  # [B, N]
    lengths = cache.lengths[:, None]  # [B, 1]
    # [B, C] the slot each stored key was decoded at: committed slots their own, a tree node's its depth's
    decoded = torch.arange(C, device=mask.device).expand(B, C).scatter(
        1, lengths + torch.arange(N, device=mask.device), lengths + depth
    )
    return mask & (decoded[:, None, None, :] > (lengths + depth - window)[:, None, :, None])


_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _compiled(decoder: torch.nn.Module):
    """`torch.compile` of `decoder`'s forward (a decoder or its tree twin), made once per module.

    torch.compile's default shapes: the first call compiles static, the first with another tree width or cache
    capacity compiles once more with those sizes symbolic, for all later ones. `dynamic=True` from the first call
    compiled for far longer on a 9B model than these two compiles together."""
    if decoder not in _COMPILED:
        # A generate call that compiles looks hung: say what it waits for, and how to do it ahead of time.
        logger.warning(
            "hf_bole: bole_compile=True: the verify forward compiles through torch.compile in its first rounds "
            "(twice: static, then with tree widths symbolic), minutes on a 9B model; "
            "hf_bole.warmup(model, batch_size, compile=True) does it up front"
        )
        _COMPILED[decoder] = torch.compile(decoder.forward)
    return _COMPILED[decoder]


@functools.cache
def cache_argument(forward) -> str:
    """The keyword a transformers forward takes its cache by: `cache` from transformers 5.24 on, `past_key_values`
    before (5.24 still accepts the old name, with a FutureWarning)."""
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def _wrap(module: ModuleType, name: str, make_wrapper) -> None:
    original = getattr(module, name)
    if getattr(original, "__hf_bole_original__", None) is not None:
        return
    wrapper = make_wrapper(original)
    wrapper.__hf_bole_original__ = original
    setattr(module, name, wrapper)


def _kernels():
    """hf_bole's tree kernels as called from a forward: their `torch.library` ops while `torch.compile` traces one
    (`tree_forward(..., compile=True)`: opaque nodes, one graph for the whole model), the functions otherwise."""
    return kernel_ops if torch.compiler.is_compiling() else kernels


def _tree_causal_conv1d_fn(original):
    @functools.wraps(original)
    def causal_conv1d_fn(*args, bole_tree: TreeBatch | None = None, **kwargs):
        if bole_tree is None:
            return original(*args, **kwargs)  # as called: the resolved kernel's signature is its own
        named = {**dict(zip(("hidden_states", "weight", "bias"), args)), **kwargs}
        hidden_states, weight, bias = named["hidden_states"], named["weight"], named.get("bias")
        activation = named.get("activation")
        bole_tree = bole_tree.on(hidden_states.device)
        # The cache returned [committed window, node inputs] from `update_conv_state`: [B, D, W + N], as upstream's cat.
        num_nodes = bole_tree.parents.shape[1]
        window, x = hidden_states[..., :-num_nodes], hidden_states[..., -num_nodes:]
        out = _kernels().tree_causal_conv1d(x.transpose(1, 2), weight, bias, bole_tree.parents, window, activation)
        return out.transpose(1, 2)  # [B, D, N], as the layer expects

    return causal_conv1d_fn


# The GDN layers call the recurrences with these leading arguments (positionally or by name); the rest by name.
_GDN_ARGUMENTS = ("query", "key", "value", "g", "beta")


def _tree_gated_delta_rule(original):
    @functools.wraps(original)
    def gated_delta_rule(*args, bole_tree: TreeBatch | None = None, **kwargs):
        if bole_tree is None:
            # Passed on exactly as called: the implementation transformers resolved may be fla-core's, whose
            # positional order differs from the torch reference's (fla 0.6: q, k, v, g, gk, gv, beta, ...).
            return original(*args, **kwargs)
        named = {**dict(zip(_GDN_ARGUMENTS, args)), **kwargs}
        query, key, value, g, beta = (named[name] for name in _GDN_ARGUMENTS)
        bole_tree = bole_tree.on(query.device)
        initial_state = named.get("initial_state")
        use_qk_l2norm = named.get("use_qk_l2norm_in_kernel", False)
        if key.shape[2] != bole_tree.key_heads:
            # transformers 5.17 repeats q and k to the value heads before this call (later versions pass the key
            # heads): keep one copy per key head, so the kernels read and the cache stores the grouped layout.
            group = key.shape[2] // bole_tree.key_heads
            query, key = query[:, :, ::group], key[:, :, ::group]
        if bole_tree.verify == "serial":
            o, snapshots = _kernels().tree_gdn_verify_serial(
                query, key, value, g, beta, bole_tree.parents, initial_state, use_qk_l2norm_in_kernel=use_qk_l2norm
            )
            return o, GDNTreeState(use_qk_l2norm=use_qk_l2norm, snapshots=snapshots)
        o, u, log_decay = _kernels().tree_gdn_verify(
            query, key, value, g, beta, bole_tree.parents, initial_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm, ancestors=bole_tree.ancestors,
        )  # fmt: skip
        return o, GDNTreeState(use_qk_l2norm=use_qk_l2norm, key=key, u=u, log_decay=log_decay)

    return gated_delta_rule


def _tree_kimi_delta_attention(original):
    @functools.wraps(original)
    def kimi_delta_attention(*args, bole_tree: TreeBatch | None = None, **kwargs):
        if bole_tree is None:
            return original(*args, **kwargs)  # passed on exactly as called (fla's `chunk_kda` where resolved)
        named = {**dict(zip(_GDN_ARGUMENTS, args)), **kwargs}
        query, key, value, g, beta = (named[name] for name in _GDN_ARGUMENTS)  # g [B, N, H, K]
        bole_tree = bole_tree.on(query.device)
        initial_state = named.get("initial_state")
        use_qk_l2norm = named.get("use_qk_l2norm_in_kernel", False)
        if bole_tree.verify == "serial":
            o, snapshots = _kernels().tree_kda_verify_serial(
                query, key, value, g, beta, bole_tree.parents, initial_state, use_qk_l2norm_in_kernel=use_qk_l2norm
            )
            return o, GDNTreeState(use_qk_l2norm=use_qk_l2norm, snapshots=snapshots)
        o, u = _kernels().tree_kda_verify(
            query, key, value, g, beta, bole_tree.parents, initial_state, use_qk_l2norm_in_kernel=use_qk_l2norm
        )
        return o, GDNTreeState(use_qk_l2norm=use_qk_l2norm, key=key, u=u, g=g)

    return kimi_delta_attention


def _observed_recurrent_attention_mask(original):
    @functools.wraps(original)
    def create_recurrent_attention_mask(config, inputs_embeds, attention_mask, *args, **kwargs):
        # The cache comes fourth, named `past_key_values` up to transformers 5.23 and `cache` from 5.24.
        cache = args[0] if args else kwargs.get("cache", kwargs.get("past_key_values"))
        if isinstance(cache, BoleCache):
            cache.record_plain_inputs(attention_mask, kwargs.get("position_ids"), inputs_embeds.shape[1])
        return original(config, inputs_embeds, attention_mask, *args, **kwargs)

    return create_recurrent_attention_mask


def _tree_pooled_indexer(original):
    @functools.wraps(original)
    def forward(indexer, hidden_states, q_resid, attention_mask, *args, **kwargs):
        cache = args[0] if args else kwargs.get("cache")
        if not isinstance(cache, BoleCache):
            return original(indexer, hidden_states, q_resid, attention_mask, *args, **kwargs)
        # A plain forward hands the indexed layers the 2D padding mask, a tree forward the tree's 4D mask.
        if attention_mask.dim() == 2:
            return original(
                indexer, hidden_states, q_resid, attention_mask, cache=_IndexerView(cache, indexer.layer_idx)
            )
        B, N = hidden_states.shape[:2]
        view = _IndexerView(cache, indexer.layer_idx, attention_mask)
        # Each node is one query of a batch of B x N, over its own sequence: upstream's forward, unchanged.
        topk = original(
            indexer,
            hidden_states.reshape(B * N, 1, -1),
            q_resid.reshape(B * N, 1, -1),
            attention_mask.new_ones((B * N, 1), dtype=torch.bool),
            cache=view,
        )  # [B x N, 1, width] positions in the node's sequence, -1 for none
        slots = view.slots.gather(1, topk[:, 0].long().clamp(min=0))  # [B x N, width]
        return torch.where(topk[:, 0] >= 0, slots, -1).view(B, N, -1).to(topk.dtype)

    return forward


def _tree_ngram_embedding(original):
    @functools.wraps(original)
    def forward(embedding, input_ids, cache, **kwargs):
        bole_tree = kwargs.get("bole_tree")
        if bole_tree is None:
            return original(embedding, input_ids, cache, **kwargs)
        bole_tree = bole_tree.on(input_ids.device)
        B, N = input_ids.shape
        # [B, Sn + N]: the committed tokens (eos before the first), then the nodes' (kept for the commit)
        full = cache.update_conv_state(input_ids, embedding.layer_idx, state_idx=2)
        window = full[:, :-N]
        # [B, N, Sn + 1] each node's path: the Sn tokens before it on its path, then itself
        paths = kernels.tree_path_window(input_ids[..., None], bole_tree.parents, window[:, None], window.shape[1] + 1)
        # Each path as a sequence of its own, without a cache (eos in front, which the hash of the last token, reading
        # Sn tokens back, never reaches): upstream's forward, unchanged. [B x N, Sn + 1, E], the node's last.
        embeddings = original(embedding, paths[..., 0].reshape(B * N, -1), None)
        return embeddings[:, -1].reshape(B, N, -1)

    return forward


def _tree_ple_conv(original):
    @functools.wraps(original)
    def _short_conv(ple, hidden_states, cache, **kwargs):
        bole_tree = kwargs.get("bole_tree")
        if bole_tree is None:
            return original(ple, hidden_states, cache, **kwargs)
        bole_tree = bole_tree.on(hidden_states.device)
        N = hidden_states.shape[1]  # hidden_states [B, N, Dp]
        # [B, Dp, Sp + N]: the committed window, then the nodes' inputs (kept for the commit)
        full = cache.update_conv_state(hidden_states.transpose(1, 2), ple.layer_idx, state_idx=1)
        conv = ple.conv1d  # depthwise, k taps `dilation` apart
        k, dilation = conv.kernel_size[0], conv.dilation[0]
        # the same conv as a causal one of (k - 1) x dilation + 1 taps, zero between the dilated ones
        weight = conv.weight.new_zeros(conv.weight.shape[0], (k - 1) * dilation + 1)
        weight[:, ::dilation] = conv.weight[:, 0]
        return _kernels().tree_causal_conv1d(hidden_states, weight, None, bole_tree.parents, full[..., :-N], "silu")

    return _short_conv


class _IndexerView:
    """What a pooled indexer (`Family.pooled_indexer`) reads of a BoleCache, as it reads a `DynamicIndexedLayer`: the
    cached tokens of its layer after its update, `layers[i].keys [B, L, Dx]` and `layers[i].get_seq_length()` L (a
    BoleCache's own length moves only at the end of a forward).

    In a tree forward (`mask [B, 1, N, C]` given), each node's own sequence: the committed slots (padding included)
    and its root-to-node path in slot order, as decoding the path token by token would hold them, for the nodes as a
    batch of B x N one-token queries. The sequences are left-padded to one length W with tokens flagged invalid,
    which the indexer skips as it skips a left-padded row's padding: it pools from the first valid token, and a query
    at the end of W tokens sees all of them."""

    def __init__(self, cache: BoleCache, layer_idx: int, mask: torch.Tensor | None = None):
        self.cache = cache
        self.layers = {layer_idx: self}
        # mask: bool (SDPA) or additive (eager); node i sees the committed non-padding slots and its path
        self.visible = None if mask is None else mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] == 0
        self.keys: torch.Tensor | None = None
        self.slots: torch.Tensor | None = None  # [B x N, W] the slot of each position, -1 for the padding in front

    def update_indexer(self, packed_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """Writes the new tokens' packed states (`[B, q, Dx]`; `[B x N, 1, Dx]` in a tree forward) and returns what
        the indexer pools: `[B, L + q, Dx]`, or each node's sequence `[B x N, W, Dx]`."""
        if self.visible is None:
            self.keys = self.cache.update_indexer(packed_states, layer_idx)
            return self.keys
        B, N, C = self.visible.shape
        stored = self.cache.update_indexer(packed_states.view(B, N, -1), layer_idx)  # [B, C, Dx]
        slot = torch.arange(C, device=stored.device)
        kept = (slot < self.cache.lengths[:, None].to(stored.device))[:, None] | self.visible  # [B, N, C]
        # the kept slots last, in slot order (a stable sort of the flags), then the last W of them
        order = torch.sort(kept.to(torch.int8), dim=-1, stable=True).indices  # [B, N, C]
        width = int(kept.sum(-1).max())
        order = order[..., C - width :]  # [B, N, W]
        kept = kept.gather(-1, order)
        dim = stored.shape[-1]
        sequences = stored[:, None].expand(B, N, C, dim).gather(2, order[..., None].expand(B, N, width, dim))
        sequences[..., -1] *= kept  # the padding in front is invalid, whatever its slot holds
        self.keys = sequences.view(B * N, width, dim)
        self.slots = torch.where(kept, order, -1).view(B * N, width)
        return self.keys

    def get_seq_length(self) -> int:
        return self.keys.shape[-2]


class _TreeAttentionFunctions:
    """A modeling module's `ALL_ATTENTION_FUNCTIONS` whose attention functions route a tree forward with
    `attention="triton"` to `tree_attention`; every other call, and every other attribute, is the original's."""

    def __init__(self, functions):
        self._functions = functions

    def get_interface(self, attn_implementation, default):
        return functools.partial(_attention, self._functions.get_interface(attn_implementation, default))

    def __getattr__(self, name):
        return getattr(self._functions, name)


def _attention(original, *args, bole_tree: TreeBatch | None = None, **kwargs):
    if bole_tree is None or bole_tree.attention != "triton" or kwargs.get("sliding_window") is not None:
        if bole_tree is not None:
            if bole_tree.attention == "triton":
                logger.warning_once(
                    "hf_bole: the sliding-window attention layers of the verify forward run the model's own attention "
                    "with the tree's windowed mask (hf_bole's tree attention kernel has no window)"
                )
            kwargs["bole_tree"] = bole_tree  # passed on exactly as called
        return original(*args, **kwargs)
    _, query, key, value = args[:4]  # a full-attention layer's call: (module, q, k, v, mask, dropout=, scaling=)
    if kwargs.get("dropout", 0.0):
        raise ValueError("hf_bole's tree attention computes no dropout: put the model in eval mode (model.eval())")
    bole_tree = bole_tree.on(query.device)
    # query [B, H, N, D]; key and value: the layer's storage [B, Hkv, C, D] with the tree's KV written; the 4D mask
    # is not read (the kernel computes the same one from lengths, valid and ancestors).
    out = _kernels().tree_attention(
        query, key, value, bole_tree.lengths, bole_tree.valid, bole_tree.ancestors, scale=kwargs.get("scaling")
    )
    return out, None  # [B, N, H, D], as transformers' attention functions return it
