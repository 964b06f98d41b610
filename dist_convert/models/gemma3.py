"""Gemma 3, text (``Gemma3ForCausalLM``): GQA attention with per-head q/k RMSNorm, a GeGLU MLP (tanh GELU),
RMSNorms computing x * (1 + w), sandwich norms (input / post-attention / pre-feedforward / post-feedforward),
embeddings scaled by sqrt(hidden), attention scaled by ``query_pre_attn_scalar``, sliding-window layers with
their own RoPE base (``rope_local_base_freq``) between global layers (linear RoPE scaling on those only), tied
embeddings.

The Megatron side is Megatron-Bridge 0.6.2's ``Gemma3ModelProvider`` on megatron-core: Transformer Engine
names, the post-norms as ``linear_proj.post_layernorm`` / ``linear_fc2.post_layernorm`` (its
``TERowParallelLinearLayerNorm``), norm weights stored as HF stores them (``layernorm_zero_centered_gamma``),
``rotary_base`` (local, global), ``window_size``, ``interleaved_attn_pattern`` (local, global),
``softmax_scale`` = 1 / sqrt(query_pre_attn_scalar). The scalings have no tensor: they travel in the args.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any

import torch

from ..config import ModelConfig
from ..errors import ConvertError
from .base import (
    ATTENTION_NAMES,
    DENSE_MLP,
    DTYPE_NAMES,
    Family,
    Imported,
    Name,
    base_config,
    common_args,
    dims_of,
    get,
    hf_dtype,
    in_layer,
    layer_prefix,
    structure_problems,
)
from .llama import attention_problems

ARCHITECTURE = "Gemma3ForCausalLM"
UNPADDED = 1  # Bridge's Gemma 3 keeps the vocabulary unpadded (should_pad_vocab False): pad only where TP needs it
GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new", "gelu_fast")  # transformers' names of tanh-GELU
NORMS: tuple[Name, ...] = (
    ("post_attention_layernorm.weight", "self_attention.linear_proj.post_layernorm.weight", None),
    ("pre_feedforward_layernorm.weight", "pre_mlp_layernorm.weight", None),
    ("post_feedforward_layernorm.weight", "mlp.linear_fc2.post_layernorm.weight", None),
)


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


def rope_bases(hf: dict[str, Any]) -> tuple[float, float, float]:
    """(local theta, global theta, linear scaling factor of the global layers) from transformers 4 style
    (``rope_theta``, ``rope_local_base_freq``, ``rope_scaling``) or 5 style (``rope_parameters`` per layer type)."""
    params = hf.get("rope_parameters") or {}
    full, sliding = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    theta = float(full.get("rope_theta", get(hf, "rope_theta", 1_000_000.0)))
    local = float(sliding.get("rope_theta", get(hf, "rope_local_base_freq", 10_000.0)))
    scaling = hf.get("rope_scaling") or (full if full.get("rope_type", "default") != "default" else None)
    factor = 1.0
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind != "linear":
            raise ConvertError(f"Gemma 3 RoPE scaling {kind!r}: Megatron-Bridge's Gemma 3 scales the global layers "
                               "linearly only", "convert a config with rope_scaling null or of type linear")
        factor = float(scaling.get("factor", 1.0))
    if (sliding.get("rope_type") or "default") != "default":
        raise ConvertError(f"Gemma 3 RoPE scaling on the sliding-window layers ({sliding}) has no megatron-core "
                           "equivalent", "convert a config without rope scaling on sliding_attention")
    return local, theta, factor


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
        local, theta, factor = rope_bases(hf)
        pattern = attention_pattern(hf, d.layers)
        cfg = ModelConfig(
            num_layers=d.layers, hidden_size=d.hidden, ffn_hidden_size=d.ffn, num_attention_heads=d.heads,
            num_query_groups=d.groups, kv_channels=d.head_dim, swiglu=True, activation="gelu_tanh",
            normalization="RMSNorm", zero_centered_gamma=True, post_norms=True, add_bias_linear=False,
            add_qkv_bias=False, untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", True),
            vocab_size=d.vocab, make_vocab_size_divisible_by=vocab_divisible_by or UNPADDED,
            position_embedding_type="rope", max_position_embeddings=int(get(hf, "max_position_embeddings", 131072)),
            qk_layernorm=True, spec="te")
        scalar = float(get(hf, "query_pre_attn_scalar", d.head_dim))
        window = hf.get("sliding_window")
        args = common_args(
            d, cfg, hf_dtype(hf), theta, hf, glu_activation="gelu_tanh", post_norms=True, apply_layernorm_1p=True,
            layernorm_zero_centered_gamma=True, rotary_base_local=local, rope_scaling_factor=factor,
            use_rope_scaling=False, window_size=(int(window) - 1, 0) if window else None,
            interleaved_attn_pattern=pattern, softmax_scale=1.0 / math.sqrt(scalar), query_pre_attn_scalar=scalar,
            embedding_multiplier=math.sqrt(d.hidden))
        return Imported(cfg=cfg, args=args, notes=[])

    def to_hf(self, cfg: ModelConfig, args: argparse.Namespace, base: dict[str, Any] | None,
              dtype: torch.dtype) -> dict[str, Any]:
        hf, same = base_config(self, base)
        name = DTYPE_NAMES.get(dtype, "float32")
        hf.update({
            "architectures": [self.architecture], "model_type": self.model_type,
            "hidden_activation": "gelu_pytorch_tanh", "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.ffn_hidden_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_query_groups,
            "head_dim": cfg.kv_channels, "vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tied,
            "max_position_embeddings": int(cfg.max_position_embeddings or 131072), "torch_dtype": name, "dtype": name})
        if same:
            return hf
        local, glob = get(vars(args), "interleaved_attn_pattern", (5, 1))
        scalar = get(vars(args), "query_pre_attn_scalar", None)
        if scalar is None:
            scale = get(vars(args), "softmax_scale", 1.0 / math.sqrt(cfg.kv_channels))
            scalar = round(1.0 / scale ** 2, 6)
        window = get(vars(args), "window_size", None)
        factor = float(get(vars(args), "rope_scaling_factor", 1.0))
        full: dict[str, Any] = {"rope_type": "default", "rope_theta": float(get(vars(args), "rotary_base", 1e6))}
        if factor != 1.0:
            full.update(rope_type="linear", factor=factor)
        hf.update({
            "rms_norm_eps": float(get(vars(args), "norm_epsilon", 1e-6)), "query_pre_attn_scalar": scalar,
            "sliding_window": int(window[0]) + 1 if isinstance(window, (tuple, list)) else window,
            "layer_types": ["sliding_attention" if i % (local + glob) < local else "full_attention"
                            for i in range(cfg.num_layers)],
            "rope_parameters": {"full_attention": full, "sliding_attention": {
                "rope_type": "default", "rope_theta": float(get(vars(args), "rotary_base_local", 1e4))}},
            "final_logit_softcapping": None, "attn_logit_softcapping": None, "attention_bias": False})
        return hf

    def affinity(self, cfg: ModelConfig) -> int:
        return 5 if cfg.post_norms else 0

    def why_not(self, cfg: ModelConfig, args: argparse.Namespace) -> str | None:
        problems = structure_problems(cfg, activation="gelu_tanh", gemma_norms=True) + attention_problems(
            cfg, qkv_bias=False, qk_norm=True)
        if cfg.num_experts:
            problems.append("Mixture-of-Experts layers")
        return ", ".join(problems) or None

    def layer_names(self, cfg: ModelConfig, stack: str, layer: int) -> list[Name]:
        return in_layer(ATTENTION_NAMES + NORMS + DENSE_MLP, layer_prefix(stack, layer))


FAMILIES = (Gemma3(),)
