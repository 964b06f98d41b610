"""Gemma 3, text (``Gemma3ForCausalLM``): GQA attention with per-head q/k RMSNorm, a GeGLU MLP (tanh GELU),
RMSNorms computing x * (1 + w), sandwich norms (input / post-attention / pre-feedforward / post-feedforward),
embeddings scaled by sqrt(hidden), attention scaled by ``query_pre_attn_scalar``, sliding-window layers with
their own RoPE base (``rope_local_base_freq``) between global layers (linear RoPE scaling on those only), tied
embeddings.

The Megatron side is Megatron-Bridge 0.6.2's ``Gemma3ModelProvider`` on megatron-core: Transformer Engine
names, the post-norms as ``linear_proj.post_layernorm`` / ``linear_fc2.post_layernorm`` (its
``TERowParallelLinearLayerNorm``), norm weights stored as HF stores them (``layernorm_zero_centered_gamma``),
``rotary_base`` (local, global), ``window_size``, ``interleaved_attn_pattern`` (local, global),
``softmax_scale`` = 1 / sqrt(query_pre_attn_scalar). The scalings have no tensor: the records carry them.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..config import ModelConfig
from ..errors import ConvertError
from ..features import MLP, Attention, Embedding, Linear, Norms, Position
from ..features.expressed import scaling_settings
from .base import (
    ANY,
    ATTENTION,
    COMMON,
    COMMON_HF_KEYS,
    DTYPE_NAMES,
    GATED_MLP,
    Allowed,
    Family,
    Imported,
    base_config,
    dims_of,
    get,
    hf_window,
    in_layer,
    layer_prefix,
)
from .llama import gqa_core
from .rows import Plain, Row

ARCHITECTURE = "Gemma3ForCausalLM"
UNPADDED = 1  # Bridge's Gemma 3 keeps the vocabulary unpadded (should_pad_vocab False): pad only where TP needs it
GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new", "gelu_fast")  # transformers' names of tanh-GELU
NORMS: tuple[Row, ...] = tuple(Plain(hf=hf, logical=lg) for hf, lg in (
    ("post_attention_layernorm.weight", "self_attention.linear_proj.post_layernorm.weight"),
    ("pre_feedforward_layernorm.weight", "pre_mlp_layernorm.weight"),
    ("post_feedforward_layernorm.weight", "mlp.linear_fc2.post_layernorm.weight"),
))


def attention_pattern(hf: dict[str, Any], layers: int) -> tuple[int, int]:
    """(local, global): ``local`` sliding-window layers, then one global layer, repeated (Bridge's
    ``interleaved_attn_pattern``); from ``layer_types`` or ``sliding_window_pattern`` (default 6)."""
    types = hf.get("layer_types")
    if not types:
        period = int(get(hf, "sliding_window_pattern", 6))
        return period - 1, 1
    local = next((i for i, t in enumerate(types) if t != "sliding_attention"), len(types))
    want = ["sliding_attention" if (i % (local + 1)) < local else "full_attention" for i in range(layers)]
    if list(types) != want or set(types) - {"sliding_attention", "full_attention"}:
        raise ConvertError(f"layer_types {types} are not {local} sliding-window layers then one global layer, "
                           "repeated: megatron-core's Gemma 3 interleaves attention in that pattern only",
                           "convert a config whose layer_types repeat (sliding x N, full)")
    return local, 1


def gemma_position(hf: dict[str, Any]) -> Position:
    """The RoPE of transformers 4 style (``rope_theta``, ``rope_local_base_freq``, ``rope_scaling``) or 5 style
    (``rope_parameters`` per layer type) configs: global base, local base, linear scaling of the global layers."""
    params = hf.get("rope_parameters") or {}
    full, sliding = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    theta = float(full.get("rope_theta", get(hf, "rope_theta", 1_000_000.0)))
    local = float(sliding.get("rope_theta", get(hf, "rope_local_base_freq", 10_000.0)))
    scaling = hf.get("rope_scaling") or (full if full.get("rope_type", "default") != "default" else None)
    pos = Position(kind="rope", base=theta, local_base=local)
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind != "linear":
            raise ConvertError(f"Gemma 3 RoPE scaling {kind!r}: Megatron-Bridge's Gemma 3 scales the global layers "
                               "linearly only", "convert a config with rope_scaling null or of type linear")
        factor = float(scaling.get("factor", 1.0))
        if factor != 1.0:
            pos = Position(kind="rope", base=theta, local_base=local, scaling=Linear(factor=factor))
    if (sliding.get("rope_type") or "default") != "default":
        raise ConvertError(f"Gemma 3 RoPE scaling on the sliding-window layers ({sliding}) has no megatron-core "
                           "equivalent", "convert a config without rope scaling on sliding_attention")
    return pos


def _number(x: float) -> int | float:
    """A whole number as an int (transformers' Gemma3TextConfig types query_pre_attn_scalar as one)."""
    return int(x) if float(x).is_integer() else x


@dataclass(frozen=True, kw_only=True)
class Gemma3(Family):
    architecture: str = ARCHITECTURE
    model_type: str = "gemma3_text"

    def from_hf(self, hf: dict[str, Any], vocab_divisible_by: int | None) -> Imported:
        d = dims_of(hf)
        act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in GELU_TANH:
            raise ConvertError(f"hidden_activation={act!r}: Megatron-Bridge's Gemma 3 gates with tanh-GELU",
                               "convert a config with hidden_activation gelu_pytorch_tanh")
        for key in ("final_logit_softcapping", "attn_logit_softcapping"):
            if hf.get(key):
                raise ConvertError(f"{key}={hf[key]}: megatron-core's Gemma 3 has no logit soft-capping",
                                   f"convert a config with {key} null (as Gemma 3 releases have)")
        if hf.get("attention_bias") or hf.get("use_bidirectional_attention"):
            raise ConvertError("attention_bias / use_bidirectional_attention = true have no equivalent in "
                               "Megatron-Bridge's Gemma 3", "convert a causal Gemma 3 without attention biases")
        scalar = float(get(hf, "query_pre_attn_scalar", d.head_dim))
        window = hf.get("sliding_window")
        cfg = ModelConfig(
            **gqa_core(d, hf, vocab_divisible_by or UNPADDED,
                       untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", True),
                       max_position_embeddings=int(get(hf, "max_position_embeddings", 131072))),
            position=gemma_position(hf),
            attention=Attention(qk_norm=True, softmax_scale=1.0 / math.sqrt(scalar),
                                window=hf_window(window) if window is not None else None,
                                window_pattern=attention_pattern(hf, d.layers) if window is not None else None),
            norm=Norms(kind="RMSNorm", eps=float(get(hf, "rms_norm_eps", 1e-6)), zero_centered_gamma=True,
                       post_norms=True),
            mlp=MLP(gated=True, activation="gelu_tanh"), embedding=Embedding(multiplier=math.sqrt(d.hidden)))
        return Imported(cfg=cfg, notes=[])

    @property
    def hf_keys(self) -> frozenset[str]:
        return COMMON_HF_KEYS | {"hidden_activation", "hidden_act", "final_logit_softcapping", "attn_logit_softcapping",
                                 "attention_bias", "use_bidirectional_attention", "query_pre_attn_scalar",
                                 "sliding_window", "layer_types", "rope.rope_type"}

    def to_hf(self, cfg: ModelConfig, base: dict[str, Any] | None, dtype: torch.dtype) -> dict[str, Any]:
        hf, same = base_config(self, base)
        name = DTYPE_NAMES.get(dtype, "float32")
        a, pos = cfg.attention, cfg.position
        scale = a.softmax_scale or 1.0 / math.sqrt(cfg.kv_channels)
        local, glob = a.window_pattern or (5, 1)
        hf.update({
            "architectures": [self.architecture], "model_type": self.model_type,
            "hidden_activation": "gelu_pytorch_tanh", "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.ffn_hidden_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_query_groups,
            "head_dim": cfg.kv_channels, "vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tied,
            "max_position_embeddings": int(cfg.max_position_embeddings or 131072), "torch_dtype": name, "dtype": name,
            "rms_norm_eps": cfg.norm.eps, "query_pre_attn_scalar": _number(round(1.0 / scale ** 2, 6)),
            "sliding_window": a.window[0] + 1 if a.window else None,
            "layer_types": ["sliding_attention" if a.window and i % (local + glob) < local else "full_attention"
                            for i in range(cfg.num_layers)],
            "final_logit_softcapping": None, "attn_logit_softcapping": None, "attention_bias": False})
        if same and gemma_position(hf) == pos:  # the source's spelling of the same RoPE
            return hf
        full: dict[str, Any] = {"rope_type": "default", "rope_theta": float(pos.base)}
        if isinstance(pos.scaling, Linear):
            full.update(rope_type="linear", factor=pos.scaling.factor)
        for key in ("rope_theta", "rope_local_base_freq", "rope_scaling"):
            hf.pop(key, None)
        hf["rope_parameters"] = {"full_attention": full, "sliding_attention": {
            "rope_type": "default", "rope_theta": float(pos.local_base or 10_000.0)}}
        return hf

    def expresses(self) -> Mapping[str, Allowed]:
        return {**COMMON, "position.local_base": ANY, **scaling_settings("linear"), "attention.qk_norm": {True},
                "attention.softmax_scale": ANY,
                "attention.window": lambda w, cfg: w is None or w[1] == 0,
                "attention.window_pattern": lambda p, cfg: p is None or p[1] == 1,
                "norm.zero_centered_gamma": {True}, "norm.post_norms": {True}, "mlp.activation": {"gelu_tanh"},
                "embedding.multiplier": lambda m, cfg: m == math.sqrt(cfg.hidden_size)}

    def layer_names(self, cfg: ModelConfig, stack: str, layer: int) -> list[Row]:
        return in_layer(ATTENTION + NORMS + GATED_MLP, layer_prefix(stack, layer))


FAMILIES = (Gemma3(),)
