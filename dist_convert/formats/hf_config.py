"""Hugging Face ``config.json`` <-> model config and Megatron-LM args, for the supported families.

Pure functions: no files, no processes. The HF config a checkpoint came from travels in the
Megatron args (``args.hf_config``) so that an export writes the same ``config.json`` back.
"""
from __future__ import annotations

import argparse
import copy
from dataclasses import dataclass
from typing import Any

import torch

from ..config import ModelConfig, padded_vocab_size
from ..errors import ConvertError

DEFAULT_DIVISIBLE_BY = 128  # Megatron-LM's --make-vocab-size-divisible-by default


@dataclass(frozen=True)
class Family:
    architecture: str
    model_type: str
    qkv_bias: bool  # q/k/v projections carry biases (Qwen2)
    qk_norm: bool  # per-head RMSNorm on queries and keys (Qwen3)


FAMILIES: dict[str, Family] = {f.architecture: f for f in (
    Family("LlamaForCausalLM", "llama", False, False),
    Family("MistralForCausalLM", "mistral", False, False),
    Family("Qwen2ForCausalLM", "qwen2", True, False),
    Family("Qwen3ForCausalLM", "qwen3", False, True),
)}

HF_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Megatron-core's Llama-3 RoPE scaling implements only these frequency parameters.
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def family_of(hf: dict[str, Any]) -> Family:
    archs = hf.get("architectures") or []
    for a in archs:
        if a in FAMILIES:
            return FAMILIES[a]
    raise ConvertError(f"unsupported Hugging Face architecture {archs or hf.get('model_type')!r}",
                       f"supported architectures: {', '.join(FAMILIES)}")


def rope_of(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope theta, scaling parameters or None), from transformers 4 or 5 style configs."""
    params = hf.get("rope_parameters") or {}
    theta = hf.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    return float(theta), scaling


def config_from_hf(hf: dict[str, Any], vocab_divisible_by: int | None) -> tuple[ModelConfig, argparse.Namespace,
                                                                                    list[str]]:
    """Model config, Megatron-LM args and notes for an HF ``config.json``."""
    fam = family_of(hf)
    try:
        heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        layers, ffn, vocab = int(hf["num_hidden_layers"]), int(hf["intermediate_size"]), int(hf["vocab_size"])
    except KeyError as e:
        raise ConvertError(f"config.json lacks {e.args[0]}", "use the config.json saved with the model") from None
    if hf.get("hidden_act", "silu") != "silu":
        raise ConvertError(f"hidden_act={hf['hidden_act']!r} is not supported", "only SiLU-gated (SwiGLU) MLPs convert")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise ConvertError(f"{flag}=true (biases on o_proj or the MLP) has no megatron-core equivalent",
                               "convert models without those biases")
    groups = int(hf.get("num_key_value_heads") or heads)
    kv = int(hf.get("head_dim") or hidden // heads)
    theta, scaling = rope_of(hf)
    notes: list[str] = []
    rope_args: dict[str, Any] = {"use_rope_scaling": False}
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        fixed = all(float(scaling.get(k, v)) == v for k, v in _LLAMA3_FIXED.items())
        if kind == "llama3" and fixed:
            rope_args = {"use_rope_scaling": True, "rope_scaling_factor": float(scaling.get("factor", 8.0))}
        else:
            notes.append(f"RoPE scaling {scaling} has no Megatron-LM argument; it is kept only in args.hf_config")
    if hf.get("sliding_window") and hf.get("use_sliding_window", fam.model_type == "mistral"):
        notes.append(f"sliding_window={hf['sliding_window']} is kept only in args.hf_config (set "
                     "--window-size in Megatron-LM to train with it)")
    cfg = ModelConfig(
        num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn, num_attention_heads=heads,
        num_query_groups=groups, kv_channels=kv, swiglu=True, normalization="RMSNorm", add_bias_linear=False,
        add_qkv_bias=fam.qkv_bias, untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        vocab_size=vocab, make_vocab_size_divisible_by=vocab_divisible_by or DEFAULT_DIVISIBLE_BY,
        position_embedding_type="rope", max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        qk_layernorm=fam.qk_norm, spec="te")
    dtype = HF_DTYPES.get(str(hf.get("dtype") or hf.get("torch_dtype") or "float32"), torch.float32)
    args = argparse.Namespace(
        num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn, num_attention_heads=heads,
        group_query_attention=groups != heads, num_query_groups=groups, kv_channels=kv, swiglu=True,
        normalization="RMSNorm", norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)), add_bias_linear=False,
        add_qkv_bias=fam.qkv_bias, qk_layernorm=fam.qk_norm,
        untie_embeddings_and_output_weights=cfg.untie_embeddings_and_output_weights,
        vocab_size=vocab, make_vocab_size_divisible_by=cfg.make_vocab_size_divisible_by,
        padded_vocab_size=padded_vocab_size(vocab, cfg.make_vocab_size_divisible_by, 1),
        position_embedding_type="rope", use_rotary_position_embeddings=True, rotary_base=theta,
        rotary_percent=1.0, max_position_embeddings=cfg.max_position_embeddings,
        seq_length=cfg.max_position_embeddings, hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, transformer_impl="transformer_engine",
        tokenizer_type="HuggingFaceTokenizer", hf_config=copy.deepcopy(hf), **rope_args)
    return cfg, args, notes


def export_family(cfg: ModelConfig, args: argparse.Namespace) -> Family:
    """The HF family a megatron-core model exports as; refuses models no supported family expresses."""
    problems = []
    if cfg.family != "gpt":
        problems.append(f"an encoder-decoder ({cfg.family.upper()}) architecture")
    if not cfg.swiglu:
        problems.append("a non-gated MLP")
    if cfg.normalization != "RMSNorm":
        problems.append(f"{cfg.normalization}")
    if cfg.add_bias_linear:
        problems.append("linear-layer biases")
    if cfg.position_embedding_type != "rope":
        problems.append(f"{cfg.position_embedding_type} position embeddings")
    if cfg.qk_layernorm and cfg.add_qkv_bias:
        problems.append("both q/k layernorm and qkv biases")
    if problems:
        raise ConvertError(f"the model has {', '.join(problems)}, which none of the supported Hugging Face "
                           f"families ({', '.join(FAMILIES)}) express",
                           "export only Llama/Mistral/Qwen-shaped models (RMSNorm, SwiGLU, RoPE) with --dst-format hf")
    hf = getattr(args, "hf_config", None)
    if isinstance(hf, dict):
        for a in hf.get("architectures") or []:
            fam = FAMILIES.get(a)
            if fam and (fam.qkv_bias, fam.qk_norm) == (cfg.add_qkv_bias, cfg.qk_layernorm):
                return fam
    key = (cfg.add_qkv_bias, cfg.qk_layernorm)
    return {(True, False): FAMILIES["Qwen2ForCausalLM"], (False, True): FAMILIES["Qwen3ForCausalLM"]}.get(
        key, FAMILIES["LlamaForCausalLM"])


def hf_from_config(cfg: ModelConfig, args: argparse.Namespace, dtype: torch.dtype) -> dict[str, Any]:
    """``config.json`` for the model: the original HF config when the args carry one, updated."""
    fam = export_family(cfg, args)
    base = getattr(args, "hf_config", None)
    same_family = isinstance(base, dict) and family_of_or_none(base) == fam
    hf: dict[str, Any] = copy.deepcopy(base) if same_family else {}
    hf.update({
        "architectures": [fam.architecture], "model_type": fam.model_type, "hidden_act": "silu",
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_query_groups, "head_dim": cfg.kv_channels, "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": cfg.tied, "max_position_embeddings": int(cfg.max_position_embeddings or 4096),
    })
    hf.setdefault("rms_norm_eps", float(getattr(args, "norm_epsilon", 1e-5) or 1e-5))
    if not same_family:
        hf["rope_theta"] = float(getattr(args, "rotary_base", 10000.0) or 10000.0)
        if getattr(args, "use_rope_scaling", False):
            hf["rope_scaling"] = {"rope_type": "llama3", "factor": float(getattr(args, "rope_scaling_factor", 8.0)),
                                  **_LLAMA3_FIXED}
    name = {v: k for k, v in HF_DTYPES.items()}.get(dtype, "float32")
    hf["torch_dtype"] = name  # transformers 4 reads torch_dtype, 5 reads dtype
    hf["dtype"] = name
    return hf


def family_of_or_none(hf: dict[str, Any]) -> Family | None:
    try:
        return family_of(hf)
    except ConvertError:
        return None
