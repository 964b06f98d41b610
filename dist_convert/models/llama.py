"""Llama, Mistral, Qwen2 and Qwen3 (``*ForCausalLM``): GQA attention (Qwen2 with q/k/v biases, Qwen3 with
per-head q/k RMSNorm, Mistral with a sliding window), a SwiGLU MLP, RMSNorm, RoPE (Llama-3 frequency scaling and
YaRN included)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..config import ModelConfig
from ..errors import ConvertError
from ..features import MLP, Attention, Norms, Position
from ..features.expressed import scaling_settings
from .base import (
    ANY,
    ATTENTION,
    COMMON,
    COMMON_HF_KEYS,
    DTYPE_NAMES,
    GATED_MLP,
    PRE_MLP_NORM,
    Allowed,
    Dims,
    Family,
    Imported,
    base_config,
    check_silu,
    dims_of,
    divisible,
    get,
    hf_window,
    in_layer,
    layer_prefix,
)
from .rope import position_from_hf, rope_params, rope_to_hf
from .rows import Row

# what the GQA families write of RoPE: plain RoPE (any base), Llama-3 scaling, YaRN
GQA_ROPE: dict[str, Allowed] = {
    "position.kind": {"rope", "yarn"}, **scaling_settings("llama3", "yarn")}
GQA_HF_KEYS = COMMON_HF_KEYS | {"rope.rope_type", "attention_bias", "mlp_bias", "hidden_act"}
ROPE_KINDS = ("default", "llama3", "yarn")


def gqa_core(d: Dims, hf: dict[str, Any], vocab_divisible_by: int | None, **kw: Any) -> dict[str, Any]:
    """The core fields of a decoder with GQA attention and no linear biases (``kw``: a family's records and
    overrides)."""
    return {"num_layers": d.layers, "hidden_size": d.hidden, "ffn_hidden_size": d.ffn, "num_attention_heads": d.heads,
            "num_query_groups": d.groups, "kv_channels": d.head_dim, "add_bias_linear": False, "add_qkv_bias": False,
            "untie_embeddings_and_output_weights": not hf.get("tie_word_embeddings", False), "vocab_size": d.vocab,
            "make_vocab_size_divisible_by": divisible(vocab_divisible_by),
            "max_position_embeddings": int(get(hf, "max_position_embeddings", 4096)), "spec": "te", **kw}


def gqa_import(hf: dict[str, Any], vocab_divisible_by: int | None, name: str, *, qkv_bias: bool, qk_norm: bool,
               window: bool = False, partial_default: float = 1.0,
               **records: Any) -> ModelConfig:
    """The part of a Llama-shaped import every GQA family shares (``records``: a family's feature records);
    ``window``: the family maps ``sliding_window`` (applied to every layer unless ``use_sliding_window`` says no),
    else a window that applies is refused."""
    d = dims_of(hf)
    check_silu(hf)
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise ConvertError(f"{flag}=true (biases on o_proj or the MLP) has no megatron-core equivalent",
                               "convert models without those biases")
    size = hf.get("sliding_window")
    slides = (size is not None if window else bool(size)) and bool(hf.get("use_sliding_window", window))
    types = hf.get("layer_types")
    if types and "sliding_attention" in types and not window:
        raise ConvertError(f"layer_types {types}: {name} here converts full attention on every layer",
                           "convert a config without sliding-window layers (use_sliding_window false)")
    if slides and not window:
        raise ConvertError(f"sliding_window={size} with use_sliding_window=true: {name}'s per-layer sliding "
                           "window (max_window_layers) is not converted", "convert a config with use_sliding_window "
                                                                         "false (as the releases have)")
    attention = Attention(qk_norm=qk_norm, window=hf_window(size) if slides else None)
    return ModelConfig(**gqa_core(d, hf, vocab_divisible_by, add_qkv_bias=qkv_bias), attention=attention,
                       position=position_from_hf(hf, name, kinds=ROPE_KINDS, partial_default=partial_default),
                       mlp=MLP(gated=True, activation="silu"),
                       norm=Norms(kind="RMSNorm", eps=float(get(hf, "rms_norm_eps", 1e-6))), **records)


def write_rope(hf: dict[str, Any], pos: Position, same: bool, partial_default: float = 1.0) -> None:
    """The model's RoPE into config.json: the source's own spelling kept when it says the same (``same``;
    ``partial_default``: the family's rotated share when config.json states none), else ``rope_parameters`` where
    the config has them, else transformers 4's ``rope_theta`` / ``rope_scaling`` / ``partial_rotary_factor``."""
    if same:
        try:
            kept = position_from_hf(hf, "", kinds=(rope_params(hf)["rope_type"],), partial_default=partial_default)
        except ConvertError:
            kept = None
        if kept == replace(pos, mla_names=False):
            return
    params = rope_to_hf(pos)
    share = params.pop("partial_rotary_factor", 1.0)
    hf.pop("rope_scaling", None)
    if "partial_rotary_factor" in hf or share != partial_default:
        hf["partial_rotary_factor"] = share
    if "rope_parameters" in hf:
        hf["rope_parameters"] = {**params, "partial_rotary_factor": share} if share != 1.0 else params
        hf.pop("rope_theta", None)
        return
    hf["rope_theta"] = params.pop("rope_theta")
    if params["rope_type"] != "default":
        hf["rope_scaling"] = params


def gqa_to_hf(fam: Family, cfg: ModelConfig, base: dict[str, Any] | None, dtype: torch.dtype,
              partial_default: float = 1.0) -> tuple[dict[str, Any], bool]:
    """The ``config.json`` keys every Llama-shaped family writes (and whether ``base`` was of ``fam``)."""
    hf, same = base_config(fam, base)
    hf.update({
        "architectures": [fam.architecture], "model_type": fam.model_type, "hidden_act": "silu",
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_query_groups, "head_dim": cfg.kv_channels, "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": cfg.tied, "max_position_embeddings": int(cfg.max_position_embeddings or 4096),
        "rms_norm_eps": cfg.norm.eps})
    write_rope(hf, cfg.position, same, partial_default)
    name = DTYPE_NAMES.get(dtype, "float32")
    hf["torch_dtype"] = name  # transformers 4 reads torch_dtype, 5 reads dtype
    hf["dtype"] = name
    return hf, same


def gqa_expresses(*, qkv_bias: bool | None, qk_norm: bool) -> dict[str, Allowed]:
    """What a GQA family writes of the attention (``qkv_bias`` None: either)."""
    return {**COMMON, **GQA_ROPE, "add_qkv_bias": ANY if qkv_bias is None else {qkv_bias},
            "attention.qk_norm": {qk_norm}}


@dataclass(frozen=True, kw_only=True)
class Llama(Family):
    """A dense Llama-shaped family; the variants differ in q/k/v biases, q/k norms and the sliding window."""

    architecture: str
    model_type: str
    qkv_bias: bool = False
    qk_norm: bool = False
    window: bool = False  # config.json's sliding_window is the model's window (Mistral)

    def from_hf(self, hf: dict[str, Any], vocab_divisible_by: int | None) -> Imported:
        cfg = gqa_import(hf, vocab_divisible_by, self.architecture, qkv_bias=self.qkv_bias, qk_norm=self.qk_norm,
                         window=self.window)
        return Imported(cfg=cfg, notes=[])

    @property
    def hf_keys(self) -> frozenset[str]:
        return GQA_HF_KEYS | {"sliding_window", "use_sliding_window", "layer_types"}

    def to_hf(self, cfg: ModelConfig, base: dict[str, Any] | None, dtype: torch.dtype) -> dict[str, Any]:
        hf, _ = gqa_to_hf(self, cfg, base, dtype)
        if self.window:
            hf["sliding_window"] = cfg.attention.window[0] + 1 if cfg.attention.window else None
        return hf

    def expresses(self) -> Mapping[str, Allowed]:
        out = gqa_expresses(qkv_bias=self.qkv_bias, qk_norm=self.qk_norm)
        if self.window:  # every layer slides, or none
            out["attention.window"] = lambda w, cfg: w is None or (w[1] == 0 and w[0] >= 0)
        return out

    def layer_names(self, cfg: ModelConfig, stack: str, layer: int) -> list[Row]:
        return in_layer(ATTENTION + PRE_MLP_NORM + GATED_MLP, layer_prefix(stack, layer))


FAMILIES = (  # in the order of preference (models/__init__.py)
    Llama(architecture="LlamaForCausalLM", model_type="llama"),
    Llama(architecture="Qwen2ForCausalLM", model_type="qwen2", qkv_bias=True),
    Llama(architecture="Qwen3ForCausalLM", model_type="qwen3", qk_norm=True),
    Llama(architecture="MistralForCausalLM", model_type="mistral", window=True),
)
