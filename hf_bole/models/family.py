"""What tree mode needs to know of one architecture, described once per family (`hf_bole/models/families/`).

hf_bole verifies trees on transformers' own modeling classes, through seams their modeling modules already make
swappable (`hf_bole/models/adapter.py`). Every Gated DeltaNet (GDN) family in transformers copies the same GDN code
(Qwen3-Next's): the module-level functions `causal_conv1d_fn`, `torch_chunk_gated_delta_rule`,
`torch_recurrent_gated_delta_rule`, `create_recurrent_attention_mask` and `ALL_ATTENTION_FUNCTIONS`, called with the
same arguments. The Kimi Delta Attention (KDA) layers of Kimi-Linear, Bailing-Hybrid and GLM-5-Next have the same
seams with `chunk_kimi_delta_attention` and `recurrent_kimi_delta_attention` for the recurrence (a log-decay per key
channel).
What differs between families is small and is what a `Family` says:

    modules               the modeling module of each text config `model_type` (its seams are wrapped)
    classes               the classes verified: `...ForCausalLM`, and the text path of `...ForConditionalGeneration`
    mrope                 whether the decoder takes mRoPE position ids `[4, B, N]` (a text row and three rotary rows,
                          Qwen3.5) or text positions `[B, N]`
    attention_layers      the layer types that keep a KV cache ("full_attention"; "sliding_attention", whose tree
                          mask also drops keys further back than `config.sliding_window`)
    projection_groups     the Linears of one module that read one input, fused into one GEMM in the verify forward
                          (`models/fused.py`); the first group a module holds wins
    zero_centred_norms,   RMSNorm classes whose forward is exactly `kernels.rms_norm`'s (`(1 + w)` in float32) or
    gated_norms           `kernels.gated_rms_norm`'s (SiLU gate, normalised row rounded first), run as one kernel each
                          in an eager verify forward (`models/norms.py`); others keep transformers' forward
    rotary                whether the modules' `apply_rotary_pos_emb` computes what `kernels.rotary` does (partial
                          rotary included, bit for bit), run as one kernel in an eager verify forward
    mtp                   whether checkpoints ship Qwen3.5's `mtp.*` head (`models/mtp.py`), which transformers drops
    kda                   whether the linear layers are KDA (`tree_kda_verify`, g per key channel) rather than GDN
    pooled_indexer        the class of a DSA indexer that pools groups of consecutive cached tokens (GLM-5-Next's): in
                          tree mode its forward runs on each node's own sequence, the committed slots and its path
                          (`adapter._tree_pooled_indexer`)
    min_tree_nodes        the fewest nodes a verify forward runs: a layer whose one-token path writes its conv window
                          in place, with no way for the cache to turn it off, is never given one token in tree mode
                          (a lone root gets a padding node, whose output is dropped)
    tree_attention_kernel whether `kernels.tree_attention` takes the attention layers' heads ("auto" attention picks
                          it on CUDA); without it the layers always run the model's own attention with the tree mask
    cuda_graphs           whether a verify forward can replay from a CUDA graph: not where the model's own code reads
                          the device back mid-forward (Qwen4-Exp's indexer, `torch.nonzero` per query; GLM-5-Next's,
                          a boolean index over its pools)
    per_layer_embeddings  the classes of a per-layer embedding's n-gram hash and of its layer (Qwen4-Exp's PLE), whose
                          windows over past tokens run along each node's path in tree mode
                          (`adapter._tree_ngram_embedding`, `adapter._tree_ple_conv`)
    shipped_in            the first transformers release whose modeling code of the family hf_bole drives: older ones
                          are treated as lacking it

Adding a family is a file in `families/` and its tests; the sizes of its cached state come from its config
(`hf_bole/cache/layout.py`).
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from types import ModuleType

import transformers
from packaging import version

GDN_LAYER = "linear_attention"


@dataclass(frozen=True)
class Family:
    """One architecture's description for tree mode (see the module docstring for each field)."""

    name: str
    modules: dict[str, str]  # text config model_type -> modeling module (import path)
    classes: tuple[str, ...]
    shipped_in: str  # the first transformers release hf_bole drives it in, for the message where this one lacks it
    mrope: bool = False
    attention_layers: tuple[str, ...] = ("full_attention",)
    projection_groups: tuple[tuple[str, ...], ...] = ()
    zero_centred_norms: tuple[str, ...] = ()
    gated_norms: tuple[str, ...] = ()
    rotary: bool = False
    mtp: bool = False
    kda: bool = False
    pooled_indexer: str | None = None
    min_tree_nodes: int = 1
    tree_attention_kernel: bool = True
    cuda_graphs: bool = True
    per_layer_embeddings: tuple[str, str] | None = None

    @property
    def available(self) -> bool:
        """Whether this transformers version ships the family's modeling modules, from `shipped_in` on."""
        return _at_least(self.shipped_in) and all(_module(path) is not None for path in self.modules.values())

    def module(self, model_type: str) -> ModuleType:
        """The modeling module of text config model type `model_type`."""
        return _module(self.modules[model_type])

    def model_classes(self) -> tuple[type, ...]:
        """The classes of `classes` this transformers version has."""
        return _classes(self.classes)

    def norm_classes(self) -> tuple[tuple[type, ...], tuple[type, ...]]:
        """The classes of `zero_centred_norms` and of `gated_norms` in the family's modules."""
        modules = [self.module(t) for t in self.modules]
        find = lambda names: tuple(getattr(m, n) for n in names for m in modules if hasattr(m, n))  # noqa: E731
        return find(self.zero_centred_norms), find(self.gated_norms)

    def position_ids(self, position_ids):
        """The decoder's position ids for text positions `position_ids [B, N]`."""
        return position_ids[None].expand(4, -1, -1) if self.mrope else position_ids

    def rotary_position_ids(self, position_ids):
        """What the decoder's rotary embedding takes for text positions `position_ids [B, N]`."""
        return position_ids[None].expand(3, -1, -1) if self.mrope else position_ids


@functools.cache
def _at_least(release: str) -> bool:
    # the installed version's release numbers, so that a dev build of `release` counts as it
    return version.parse(transformers.__version__).release >= version.parse(release).release


@functools.cache
def _classes(names: tuple[str, ...]) -> tuple[type, ...]:
    return tuple(cls for name in names if (cls := getattr(transformers, name, None)) is not None)


@functools.cache
def _module(path: str) -> ModuleType | None:
    try:
        return importlib.import_module(path)
    except ImportError:
        return None


def all_families() -> tuple[Family, ...]:
    """Every family hf_bole describes, this transformers version's or not."""
    from hf_bole.models.families import FAMILIES

    return FAMILIES


def supported() -> str:
    """The families and classes hf_bole verifies with this transformers version, and those it lacks, for messages."""
    have = [f"{f.name} ({', '.join(c.__name__ for c in f.model_classes())})" for f in all_families() if f.available]
    lack = [f"{f.name} (in {f.shipped_in})" for f in all_families() if not f.available]
    return "; ".join(have) + (f"; not in transformers {transformers.__version__}: {', '.join(lack)}" if lack else "")


def family_of(config) -> Family:
    """The family of `config` (a text config, or a composite one whose text config is used).

    Raises a `ValueError` listing what is supported for any other architecture."""
    family = _family(config.model_type)  # a text config's own (reading the text config costs ~6 us a call)
    if family is None:
        model_type = config.get_text_config(decoder=True).model_type
        family = _family(model_type)
    if family is None:
        raise ValueError(f"hf_bole verifies trees on {supported()}; got a config of model type {model_type!r}")
    return family


@functools.cache  # every tree forward asks
def _family(model_type: str) -> Family | None:
    return next((f for f in all_families() if model_type in f.modules and f.available), None)
