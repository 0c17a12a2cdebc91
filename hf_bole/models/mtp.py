"""The multi-token-prediction (MTP) head that Qwen3.5 and Qwen3-Next checkpoints ship as `mtp.*` tensors (the
families with `Family.mtp`): module, loading, saving.

One MTP step maps a pair (hidden state h_t, next token x_{t+1}) at position t to a hidden state that predicts x_{t+2}:

    x = fc(cat(pre_fc_norm_embedding(embed(x_{t+1})), pre_fc_norm_hidden(h_t)))     # [B, T, 2*hidden] -> [B, T, hidden]
    o = norm(layers[0](x))                                                          # one full-attention decoder layer
    p(x_{t+2}) = softmax(lm_head(o))

`embed`, `lm_head` and the rotary embedding are the target model's own; the checkpoint holds only the head:

    mtp.fc.weight                     [hidden, 2*hidden]
    mtp.pre_fc_norm_embedding.weight  [hidden]
    mtp.pre_fc_norm_hidden.weight     [hidden]
    mtp.layers.0.*                    the target's decoder-layer class with full attention (dense MLP, or the MoE block)
    mtp.norm.weight                   [hidden]

transformers keeps these keys out of the model (`_keys_to_ignore_on_load_unexpected = [r"^mtp.*"]`) and its generic
`MtpModel` (`modeling_layers.py`) cannot be built from a Qwen3.5 or Qwen3-Next config (it needs `num_mtp_layers` and
`mtp_layer_types`, which these configs do not carry), so the head is assembled here from transformers' own layer
classes, under the checkpoint's own parameter names, so that loading is a prefix strip and saving a prefix add. The
tensors are read from the checkpoint's safetensors files, in its folder or in the local Hub cache (never downloaded:
`from_pretrained` fetched every shard the index lists).
"""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.utils import CONFIG_NAME, SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, cached_file

from hf_bole.kernels.ops import masked_attention
from hf_bole.models.adapter import cache_argument
from hf_bole.models.family import all_families, family_of
from hf_bole.placement import placement

MTP_PREFIX = "mtp."
MTP_SHARD_NAME = "model-mtp.safetensors"

# Per-expert checkpoint layout (`experts.{e}.gate_proj.weight`), fused by transformers' `qwen2_moe` conversion mapping
# into `experts.gate_up_proj` [E, 2*I, hidden] and `experts.down_proj` [E, hidden, I] on load.
_PER_EXPERT_KEY = re.compile(r"^(?P<experts>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def mtp_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    few_queries: bool = False,
    key_lengths: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    r"""
    The head's attention (registered with transformers as `"hf_bole_mtp"`): SDPA, except for a drafting round's steps
    (`few_queries=True`: a handful of queries per row against the whole cache), which take hf_bole's
    `masked_attention` kernel.

    Why: with a boolean mask SDPA takes its memory-efficient kernel, one program per (row, head, block of queries)
    walking every key slot of the storage, so its time grows with the cache, several calls a round. Batched matmuls
    and a masked softmax fared no better, cuBLAS walking every slot in one program per (row, key head) for the
    second product. The kernel
    reads the keys in place, once per key head for all its query heads, split over the GPU's programs. A prompt's
    extension (many queries, `few_queries=False`) keeps SDPA. No dropout: the drafter never trains.

    query `[B, H, Q, D]`; key, value `[B, Hkv, L, D]`; attention_mask `[B, 1, Q, L]` bool, True where a query may
    attend; key_lengths `[B]` int64 or None, with `few_queries` the slots in use of each row (the kernel reads none
    past them, `masked_attention`'s `lengths`) -> `[B, Q, H, D]` (transformers' attention functions' layout).
    """
    if not few_queries:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    return masked_attention(query, key, value, attention_mask[:, 0], scale=scaling, lengths=key_lengths), None


AttentionInterface.register("hf_bole_mtp", mtp_attention)


class Qwen3_5MTP(nn.Module):
    r"""
    The MTP head of a Qwen3.5 (dense or MoE) or Qwen3-Next model, with the checkpoint's parameter names minus the
    `mtp.` prefix.

    Build it with [`Qwen3_5MTP.for_model`] (fresh, for training) or [`Qwen3_5MTP.from_pretrained`] (checkpoint
    weights); save it with [`save_pretrained_with_mtp`].

    Args:
        text_config (`PreTrainedConfig`):
            The target's text config. Copied; the copy's one layer is full attention and runs under
            [`mtp_attention`] (SDPA, whatever the target's implementation: the drafter passes boolean tree masks that
            flash attention cannot take and eager attention would read as additive).
        decoder_layer_cls (`type[nn.Module]`):
            The target's decoder-layer class (`Qwen3_5DecoderLayer`, `Qwen3_5MoeDecoderLayer`, `Qwen3NextDecoderLayer`).
        norm_cls (`type[nn.Module]`):
            The target's RMSNorm class (`1 + weight` scaling, zero-initialised).
    """

    def __init__(self, text_config, decoder_layer_cls: type[nn.Module], norm_cls: type[nn.Module]):
        super().__init__()
        config = copy.deepcopy(text_config)
        config.layer_types = ["full_attention"]
        config.num_hidden_layers = 1
        config._attn_implementation = "hf_bole_mtp"
        self.config = config
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = norm_cls(hidden, eps=eps)
        self.pre_fc_norm_hidden = norm_cls(hidden, eps=eps)
        self.layers = nn.ModuleList([decoder_layer_cls(config, 0)])
        self.norm = norm_cls(hidden, eps=eps)
        self._family = family_of(config)
        # read once here, not in every forward, where torch.compile would trace the signature look-up
        self._cache_argument = cache_argument(decoder_layer_cls.forward)

    @classmethod
    def for_model(cls, model: PreTrainedModel) -> Qwen3_5MTP:
        """A freshly initialised head shaped for `model`, on its device and in its dtype (the training entry point)."""
        mtp = cls._build(model, device=model.get_output_embeddings().weight.device)
        mtp.apply(model._init_weights)
        return mtp.to(model.dtype)

    @classmethod
    def from_pretrained(
        cls,
        model: PreTrainedModel,
        pretrained: str | os.PathLike | None = None,
        *,
        state_dict: dict[str, torch.Tensor] | None = None,
    ) -> Qwen3_5MTP:
        r"""
        The MTP head of `model`'s checkpoint.

        Args:
            model (`PreTrainedModel`):
                A model of a family with an MTP head (Qwen3.5, Qwen3.5-MoE, Qwen3-Next). The head is placed on the
                device of its `lm_head`, in its dtype.
            pretrained (`str` or `os.PathLike`, *optional*):
                A checkpoint folder or Hub repo id (resolved through the local Hub cache, never downloaded). Defaults to
                `model.name_or_path`, the folder or repo `model` was loaded from.
            state_dict (`dict[str, torch.Tensor]`, *optional*):
                Tensors in the checkpoint's layout (`mtp.*` keys; other keys are ignored). Takes precedence over
                `pretrained`.

        Returns:
            `Qwen3_5MTP`: the head, in eval mode.

        Raises:
            `ValueError`: the checkpoint has no `mtp.*` weights, or they do not match the model's shapes.

        Example:
            ```python
            >>> model = AutoModelForCausalLM.from_pretrained("path/to/qwen3.5-checkpoint")
            >>> mtp = Qwen3_5MTP.from_pretrained(model)
            ```
        """
        _check_family(model.config.get_text_config())
        if state_dict is not None:
            source = "the given state_dict"
        else:
            pretrained = pretrained if pretrained is not None else model.name_or_path
            if not pretrained:
                raise ValueError(
                    "Cannot locate the checkpoint of this model (it has no `name_or_path`): pass `pretrained=` (a "
                    "checkpoint folder or Hub repo id) or `state_dict=` with its `mtp.*` tensors."
                )
            source = f"'{pretrained}'"
            state_dict = load_mtp_state_dict(pretrained)
        weights = _merge_per_expert_weights(
            {k.removeprefix(MTP_PREFIX): v for k, v in state_dict.items() if k.startswith(MTP_PREFIX)}
        )
        if not weights:
            raise ValueError(
                f"The checkpoint at {source} has no `mtp.*` weights, so the MTP drafter cannot be built. Use "
                f'`bole_drafter="ngram"` (prompt lookup, needs no weights) or a checkpoint that ships an MTP head.'
            )
        num_layers = len({k.split(".")[1] for k in weights if k.startswith("layers.")})
        if num_layers != 1:
            raise ValueError(
                f"The checkpoint at {source} has {num_layers} MTP layers; hf_bole drafts with exactly one (as every "
                f"published Qwen3.5 checkpoint ships)."
            )

        # Where the LM head runs: under accelerate's device_map an offloaded head's weight sits on the meta device.
        device = placement(model).output_device
        mtp = cls._build(model, device="meta")
        expected = mtp.state_dict()
        missing, unexpected = sorted(expected.keys() - weights.keys()), sorted(weights.keys() - expected.keys())
        mismatched = [k for k in expected.keys() & weights.keys() if expected[k].shape != weights[k].shape]
        if missing or unexpected or mismatched:
            raise ValueError(
                f"The `mtp.*` weights at {source} do not fit this model's MTP head: missing {missing}, unexpected "
                f"{unexpected}, wrong shape {sorted(mismatched)}."
            )
        mtp.load_state_dict({k: v.to(device=device, dtype=model.dtype) for k, v in weights.items()}, assign=True)
        return mtp.eval()

    @classmethod
    def _build(cls, model: PreTrainedModel, device: torch.device | str) -> Qwen3_5MTP:
        text_config = model.config.get_text_config()
        _check_family(text_config)
        decoder = model.get_decoder()
        with torch.device(device):
            return cls(text_config, type(decoder.layers[0]), type(decoder.norm))

    def rotary_position_ids(self, positions: torch.Tensor) -> torch.Tensor:
        """What the target's rotary embedding takes for text positions `positions [B, T]`: Qwen3.5's multimodal
        `(3, B, T)` position ids (one text position on all three axes), Qwen3-Next's `[B, T]` as they are."""
        return self._family.rotary_position_ids(positions)

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        past_key_values=None,
        few_queries: bool = False,
        key_lengths: torch.Tensor | None = None,
    ) -> torch.Tensor:
        r"""
        One MTP step for every (next-token embedding, hidden state) pair.

        Args:
            inputs_embeds (`torch.FloatTensor` of shape `(batch_size, seq_len, hidden)`):
                The target's embeddings of the next tokens x_{t+1}.
            hidden_states (`torch.FloatTensor` of shape `(batch_size, seq_len, hidden)`):
                The hidden states h_t: the target's final (normed) hidden states, or this head's own outputs when it
                recurses.
            position_embeddings (`tuple[torch.FloatTensor, torch.FloatTensor]`):
                `(cos, sin)` from the target's rotary embedding at positions t (`rotary_position_ids`).
            attention_mask (`torch.BoolTensor` of shape `(batch_size, 1, seq_len, kv_len)`, *optional*):
                True where a query may attend; `None` is causal attention over `seq_len` (training).
            past_key_values (*optional*):
                Any object with the `Cache.update(key_states, value_states, layer_idx)` method, which receives this
                step's keys/values `[batch_size, kv_heads, seq_len, head_dim]` and returns all keys/values to attend to.
            few_queries (`bool`, *optional*, defaults to `False`):
                A drafting round's step, a few entries per row with an `attention_mask`: attends through matmuls
                instead of SDPA (see [`mtp_attention`]).
            key_lengths (`torch.LongTensor` of shape `(batch_size,)`, *optional*):
                With `few_queries`, the cache slots in use of each row: no key at or past them is read, whatever the
                mask (a CUDA graph's cache is as long as its capacity, a row's entries end sooner).

        Returns:
            `torch.FloatTensor` of shape `(batch_size, seq_len, hidden)`: the normed output o_t, the `lm_head` input
            for x_{t+2} and the hidden-state input of the next MTP step.
        """
        x = torch.cat([self.pre_fc_norm_embedding(inputs_embeds), self.pre_fc_norm_hidden(hidden_states)], dim=-1)
        x = self.layers[0](
            self.fc(x),
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            few_queries=few_queries,
            key_lengths=key_lengths,
            **{self._cache_argument: past_key_values},
        )
        return self.norm(x)


def _check_family(text_config) -> None:
    if not family_of(text_config).mtp:
        with_mtp = ", ".join(f.name for f in all_families() if f.mtp)
        raise ValueError(
            f"The MTP head is defined for the families whose checkpoints ship one hf_bole reads ({with_mtp}), not "
            f"'{text_config.model_type}': draft with bole_drafter='ngram' or a small model (assistant_model=)."
        )


def load_mtp_state_dict(pretrained: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The `mtp.*` tensors of a safetensors checkpoint (single file or sharded), keys unchanged; `{}` when it has none.

    `pretrained` is a local folder or a Hub repo id; repo ids resolve through the local Hub cache only (nothing is
    downloaded: a model loaded from the Hub has every shard its index lists there). Only the shards that hold `mtp.*`
    keys are opened.
    """
    index = _local_file(pretrained, SAFE_WEIGHTS_INDEX_NAME)
    if index is not None:
        weight_map = json.loads(Path(index).read_text())["weight_map"]
        shards = sorted({shard for key, shard in weight_map.items() if key.startswith(MTP_PREFIX)})
        files = [_local_file(pretrained, shard) for shard in shards]
        missing = [shard for shard, file in zip(shards, files) if file is None]
        if missing:
            raise ValueError(
                f"The checkpoint index at '{pretrained}' puts `mtp.*` weights in {missing}, which are not there (nor in "
                f"the local Hub cache); hf_bole downloads nothing: fetch them (e.g. `huggingface_hub.snapshot_download`), "
                f"pass `state_dict=`, or use `bole_drafter=\"ngram\"`, which needs no weights."
            )
    else:
        single = _local_file(pretrained, SAFE_WEIGHTS_NAME)
        if single is None:
            raise ValueError(
                f"Found no safetensors checkpoint ({SAFE_WEIGHTS_NAME} or {SAFE_WEIGHTS_INDEX_NAME}) at '{pretrained}' "
                f'(a folder, or a repo in the local Hub cache) to read `mtp.*` weights from. Pass `state_dict=`, or use '
                f'`bole_drafter="ngram"`, which needs no weights.'
            )
        files = [single]
    tensors = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            tensors.update({key: f.get_tensor(key) for key in f.keys() if key.startswith(MTP_PREFIX)})
    return tensors


def _local_file(pretrained: str | os.PathLike, filename: str) -> str | None:
    """`filename` of the checkpoint `pretrained` (a folder, or a repo id in the local Hub cache), or None."""
    return cached_file(
        pretrained,
        filename,
        local_files_only=True,
        _raise_exceptions_for_missing_entries=False,
        _raise_exceptions_for_connection_errors=False,
    )


def save_pretrained_with_mtp(
    model: PreTrainedModel, mtp: Qwen3_5MTP, save_directory: str | os.PathLike, **kwargs
) -> None:
    r"""
    `model.save_pretrained(save_directory, **kwargs)`, plus the head as `mtp.*` tensors in the same checkpoint.

    A single-file checkpoint gets the tensors added to `model.safetensors`; a sharded one gets them in
    `model-mtp.safetensors`, listed in the index. `config.json` records `mtp_num_hidden_layers` (in `text_config` when
    the config nests one), as Qwen3.5's own configs do. `from_pretrained` ignores the `mtp.*` keys and
    [`Qwen3_5MTP.from_pretrained`] reads them back.

    Example:
        ```python
        >>> mtp = Qwen3_5MTP.for_model(model)  # ... then train it
        >>> save_pretrained_with_mtp(model, mtp, "house-model")
        >>> model = AutoModelForCausalLM.from_pretrained("house-model")
        >>> drafter = MTPDrafter.from_model(model, depth=4, topk=4)
        ```
    """
    model.save_pretrained(save_directory, **kwargs)
    folder = Path(save_directory)
    tensors = {MTP_PREFIX + k: v.detach().to("cpu").contiguous() for k, v in mtp.state_dict().items()}
    index_path = folder / SAFE_WEIGHTS_INDEX_NAME
    if index_path.exists():
        index = json.loads(index_path.read_text())
        save_file(tensors, folder / MTP_SHARD_NAME, metadata={"format": "pt"})
        index["weight_map"].update(dict.fromkeys(tensors, MTP_SHARD_NAME))
        metadata = index.setdefault("metadata", {})
        metadata["total_size"] = metadata.get("total_size", 0) + sum(t.nbytes for t in tensors.values())
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    else:
        path = folder / SAFE_WEIGHTS_NAME
        save_file({**load_file(path), **tensors}, path, metadata={"format": "pt"})
    config_path = folder / CONFIG_NAME
    config = json.loads(config_path.read_text())
    config.get("text_config", config)["mtp_num_hidden_layers"] = len(mtp.layers)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _merge_per_expert_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fuse per-expert MoE tensors into transformers' `gate_up_proj`/`down_proj` layout; other keys pass through."""
    merged, experts = {}, {}
    for key, tensor in weights.items():
        match = _PER_EXPERT_KEY.match(key)
        if match is None:
            merged[key] = tensor
        else:
            experts.setdefault(match["experts"], {}).setdefault(match["proj"], {})[int(match["e"])] = tensor
    for prefix, projs in experts.items():
        ids = sorted(projs["down_proj"])
        gate_up = [torch.cat([projs["gate_proj"][e], projs["up_proj"][e]]) for e in ids]  # [2*I, hidden] each
        merged[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
        merged[f"{prefix}.down_proj"] = torch.stack([projs["down_proj"][e] for e in ids])
    return merged
