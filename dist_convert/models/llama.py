"""Llama, Mistral, Qwen2 and Qwen3 (``*ForCausalLM``): GQA attention (Qwen2 with q/k/v biases, Qwen3 with
per-head q/k RMSNorm), a SwiGLU MLP, RMSNorm, RoPE (Llama-3's frequency scaling included)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import torch

from ..config import ModelConfig
from ..errors import ConvertError
from .base import (
    ATTENTION_NAMES,
    DENSE_MLP,
    DTYPE_NAMES,
    MLP_NORM,
    Dims,
    Family,
    Imported,
    Name,
    base_config,
    common_args,
    dims_of,
    divisible,
    hf_dtype,
    in_layer,
    layer_prefix,
    rope_of,
    structure_problems,
)

# Megatron-core's Llama-3 RoPE scaling implements only these frequency parameters.
LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def check_silu(hf: dict[str, Any]) -> None:
    if hf.get("hidden_act", "silu") != "silu":
        raise ConvertError(f"hidden_act={hf['hidden_act']!r} is not supported", "only SiLU-gated (SwiGLU) MLPs convert")


def gqa_import(hf: dict[str, Any], vocab_divisible_by: int | None, *, qkv_bias: bool, qk_norm: bool,
               sliding_default: bool, model: dict[str, Any] | None = None,
               args: dict[str, Any] | None = None) -> tuple[Dims, ModelConfig, argparse.Namespace, list[str]]:
    """The part of a Llama-shaped import every GQA family shares (``model``/``args``: a family's additions)."""
    d = dims_of(hf)
    check_silu(hf)
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise ConvertError(f"{flag}=true (biases on o_proj or the MLP) has no megatron-core equivalent",
                               "convert models without those biases")
    theta, scaling = rope_of(hf)
    notes: list[str] = []
    rope_args: dict[str, Any] = {"use_rope_scaling": False}
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        fixed = all(float(scaling.get(k, v)) == v for k, v in LLAMA3_FIXED.items())
        if kind == "llama3" and fixed:
            rope_args = {"use_rope_scaling": True, "rope_scaling_factor": float(scaling.get("factor", 8.0))}
        else:
            notes.append(f"RoPE scaling {scaling} has no Megatron-LM argument; it is kept only in the origin's "
                         "config.json")
    if hf.get("sliding_window") and hf.get("use_sliding_window", sliding_default):
        notes.append(f"sliding_window={hf['sliding_window']} is kept only in the origin's config.json (set "
                     "--window-size in Megatron-LM to train with it)")
    cfg = ModelConfig(
        num_layers=d.layers, hidden_size=d.hidden, ffn_hidden_size=d.ffn, num_attention_heads=d.heads,
        num_query_groups=d.groups, kv_channels=d.head_dim, swiglu=True, normalization="RMSNorm",
        add_bias_linear=False, add_qkv_bias=qkv_bias,
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False), vocab_size=d.vocab,
        make_vocab_size_divisible_by=divisible(vocab_divisible_by), position_embedding_type="rope",
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)), qk_layernorm=qk_norm, spec="te",
        **(model or {}))
    return d, cfg, common_args(d, cfg, hf_dtype(hf), theta, hf, **rope_args, **(args or {})), notes


def gqa_to_hf(fam: Family, cfg: ModelConfig, args: argparse.Namespace, base: dict[str, Any] | None,
              dtype: torch.dtype) -> tuple[dict[str, Any], bool]:
    """The ``config.json`` keys every Llama-shaped family writes (and whether ``base`` was of ``fam``)."""
    hf, same = base_config(fam, base)
    hf.update({
        "architectures": [fam.architecture], "model_type": fam.model_type, "hidden_act": "silu",
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_query_groups, "head_dim": cfg.kv_channels, "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": cfg.tied, "max_position_embeddings": int(cfg.max_position_embeddings or 4096),
    })
    hf.setdefault("rms_norm_eps", float(getattr(args, "norm_epsilon", 1e-5) or 1e-5))
    if not same:
        hf["rope_theta"] = float(getattr(args, "rotary_base", 10000.0) or 10000.0)
        if getattr(args, "use_rope_scaling", False):
            hf["rope_scaling"] = {"rope_type": "llama3", "factor": float(getattr(args, "rope_scaling_factor", 8.0)),
                                  **LLAMA3_FIXED}
    name = DTYPE_NAMES.get(dtype, "float32")
    hf["torch_dtype"] = name  # transformers 4 reads torch_dtype, 5 reads dtype
    hf["dtype"] = name
    return hf, same


def attention_problems(cfg: ModelConfig, *, qkv_bias: bool | None, qk_norm: bool) -> list[str]:
    """What of the attention a GQA family cannot express (``qkv_bias`` None: either)."""
    problems = []
    if cfg.mla:
        problems.append("multi-latent attention")
    if cfg.qk_layernorm != qk_norm:
        problems.append("q/k layernorm" if cfg.qk_layernorm else "no q/k layernorm")
    if qkv_bias is not None and cfg.add_qkv_bias != qkv_bias:
        problems.append("qkv biases" if cfg.add_qkv_bias else "no qkv biases")
    return problems


@dataclass(frozen=True, kw_only=True)
class Llama(Family):
    """A dense Llama-shaped family; the variants differ in q/k/v biases and q/k norms."""

    architecture: str
    model_type: str
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_default: bool = False  # config.json's sliding_window applies unless use_sliding_window says no
    prefer: bool = False  # exported as this family when the model's evidence (biases, norms) says so

    def from_hf(self, hf: dict[str, Any], vocab_divisible_by: int | None) -> Imported:
        _, cfg, args, notes = gqa_import(hf, vocab_divisible_by, qkv_bias=self.qkv_bias, qk_norm=self.qk_norm,
                                         sliding_default=self.sliding_default)
        return Imported(cfg=cfg, args=args, notes=notes)

    def to_hf(self, cfg: ModelConfig, args: argparse.Namespace, base: dict[str, Any] | None,
              dtype: torch.dtype) -> dict[str, Any]:
        return gqa_to_hf(self, cfg, args, base, dtype)[0]

    def affinity(self, cfg: ModelConfig) -> int:
        if cfg.num_experts or cfg.mla or not self.prefer:
            return 0
        if self.qkv_bias or self.qk_norm:  # Qwen2 for q/k/v biases, Qwen3 for q/k norms
            return 2 if (self.qkv_bias and cfg.add_qkv_bias) or (self.qk_norm and cfg.qk_layernorm) else 0
        return 1

    def why_not(self, cfg: ModelConfig, args: argparse.Namespace) -> str | None:
        problems = structure_problems(cfg)
        if cfg.num_experts:
            problems.append("Mixture-of-Experts layers")
        problems += attention_problems(cfg, qkv_bias=self.qkv_bias, qk_norm=self.qk_norm)
        return ", ".join(problems) or None

    def layer_names(self, cfg: ModelConfig, stack: str, layer: int) -> list[Name]:
        return in_layer(ATTENTION_NAMES + MLP_NORM + DENSE_MLP, layer_prefix(stack, layer))


FAMILIES = (
    Llama(architecture="LlamaForCausalLM", model_type="llama", prefer=True),
    Llama(architecture="MistralForCausalLM", model_type="mistral", sliding_default=True),
    Llama(architecture="Qwen2ForCausalLM", model_type="qwen2", qkv_bias=True, prefer=True),
    Llama(architecture="Qwen3ForCausalLM", model_type="qwen3", qk_norm=True, prefer=True),
)
