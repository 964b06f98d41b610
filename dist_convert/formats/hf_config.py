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

from ..config import DEFAULT_DIVISIBLE_BY, ModelConfig, padded_vocab_size
from ..errors import ConvertError
from . import hf_deepseek


@dataclass(frozen=True)
class Family:
    architecture: str
    model_type: str
    qkv_bias: bool  # q/k/v projections carry biases (Qwen2)
    qk_norm: bool  # per-head RMSNorm on queries and keys (Qwen3)
    moe: bool = False  # Mixture-of-Experts layers (router + routed experts)
    moe_block: str = "mlp"  # module of an MoE layer on disk (Mixtral: block_sparse_moe)
    expert_proj: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # per expert: gate, up, down
    shared_expert: bool = False  # every MoE layer has a sigmoid-gated shared expert (Qwen2-MoE)
    dense_layers: bool = True  # MoE families: dense MLP layers may sit between MoE layers
    qkv_bias_flag: bool = False  # config.json's "qkv_bias" switches the q/k/v biases (Qwen2-MoE)
    mla: bool = False  # multi-latent attention and DeepSeek MoE (hf_deepseek.py)


FAMILIES: dict[str, Family] = {f.architecture: f for f in (
    Family("LlamaForCausalLM", "llama", False, False),
    Family("MistralForCausalLM", "mistral", False, False),
    Family("Qwen2ForCausalLM", "qwen2", True, False),
    Family("Qwen3ForCausalLM", "qwen3", False, True),
    Family("MixtralForCausalLM", "mixtral", False, False, moe=True, moe_block="block_sparse_moe",
           expert_proj=("w1", "w3", "w2"), dense_layers=False),
    Family("Qwen2MoeForCausalLM", "qwen2_moe", True, False, moe=True, shared_expert=True, qkv_bias_flag=True),
    Family("Qwen3MoeForCausalLM", "qwen3_moe", False, True, moe=True),
    Family("DeepseekV3ForCausalLM", "deepseek_v3", False, False, moe=True, mla=True),
    Family("DeepseekV2ForCausalLM", "deepseek_v2", False, False, moe=True, mla=True),
)}
MOE_FAMILIES = tuple(f.architecture for f in FAMILIES.values() if f.moe and not f.mla)

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
    if fam.mla:
        return hf_deepseek.config_from_hf(hf, fam.architecture, vocab_divisible_by)
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
    if hf.get("sliding_window") and hf.get("use_sliding_window", fam.model_type in ("mistral", "mixtral")):
        notes.append(f"sliding_window={hf['sliding_window']} is kept only in args.hf_config (set "
                     "--window-size in Megatron-LM to train with it)")
    qkv_bias = bool(hf.get("qkv_bias", fam.qkv_bias)) if fam.qkv_bias_flag else fam.qkv_bias
    moe_cfg, moe_args = _moe_from_hf(hf, fam, layers, notes) if fam.moe else ({}, {})
    cfg = ModelConfig(
        num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn, num_attention_heads=heads,
        num_query_groups=groups, kv_channels=kv, swiglu=True, normalization="RMSNorm", add_bias_linear=False,
        add_qkv_bias=qkv_bias, untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        vocab_size=vocab, make_vocab_size_divisible_by=vocab_divisible_by or DEFAULT_DIVISIBLE_BY,
        position_embedding_type="rope", max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        qk_layernorm=fam.qk_norm, spec="te", **moe_cfg)
    dtype = HF_DTYPES.get(str(hf.get("dtype") or hf.get("torch_dtype") or "float32"), torch.float32)
    args = argparse.Namespace(
        num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn, num_attention_heads=heads,
        group_query_attention=groups != heads, num_query_groups=groups, kv_channels=kv, swiglu=True,
        normalization="RMSNorm", norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)), add_bias_linear=False,
        add_qkv_bias=qkv_bias, qk_layernorm=fam.qk_norm,
        untie_embeddings_and_output_weights=cfg.untie_embeddings_and_output_weights,
        vocab_size=vocab, make_vocab_size_divisible_by=cfg.make_vocab_size_divisible_by,
        padded_vocab_size=padded_vocab_size(vocab, cfg.make_vocab_size_divisible_by, 1),
        position_embedding_type="rope", use_rotary_position_embeddings=True, rotary_base=theta,
        rotary_percent=1.0, max_position_embeddings=cfg.max_position_embeddings,
        seq_length=cfg.max_position_embeddings, hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, transformer_impl="transformer_engine",
        tokenizer_type="HuggingFaceTokenizer", hf_config=copy.deepcopy(hf), **rope_args, **moe_args)
    return cfg, args, notes


def _int(hf: dict[str, Any], *keys: str, default: int | None = None) -> int:
    for k in keys:
        if hf.get(k) is not None:
            return int(hf[k])
    if default is None:
        raise ConvertError(f"config.json lacks {keys[0]}", "use the config.json saved with the model")
    return default


def hf_moe_pattern(layers: int, sparse_step: int, mlp_only: list[int]) -> tuple[int, ...]:
    """Pure: Qwen-MoE's rule, 1 per MoE layer: ``l not in mlp_only_layers and (l + 1) % decoder_sparse_step == 0``."""
    if sparse_step < 1:
        raise ConvertError(f"decoder_sparse_step={sparse_step} is not a positive layer step",
                           "fix decoder_sparse_step in config.json (1: every layer is MoE)")
    skip = set(mlp_only)
    return tuple(int(l not in skip and (l + 1) % sparse_step == 0) for l in range(layers))


def _moe_from_hf(hf: dict[str, Any], fam: Family, layers: int,
                 notes: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """ModelConfig fields and Megatron-LM args of an HF MoE config (Mixtral, Qwen2-MoE, Qwen3-MoE)."""
    experts = _int(hf, "num_local_experts", "num_experts")
    topk = _int(hf, "num_experts_per_tok", default=2)
    if fam.dense_layers:  # Qwen-MoE: experts of moe_intermediate_size, dense layers of intermediate_size
        expert_ffn = _int(hf, "moe_intermediate_size")
        pattern: tuple[int, ...] | None = hf_moe_pattern(layers, _int(hf, "decoder_sparse_step", default=1),
                                                         list(hf.get("mlp_only_layers") or []))
        if all(pattern):
            pattern = None
        pre_softmax = not bool(hf.get("norm_topk_prob", False))
    else:  # Mixtral: every layer MoE, experts of intermediate_size, top-k renormalised
        expert_ffn, pattern, pre_softmax = int(hf["intermediate_size"]), None, False
        if float(hf.get("router_jitter_noise") or 0.0):
            notes.append(f"router_jitter_noise={hf['router_jitter_noise']} (training-time noise) has no "
                         "Megatron-LM argument; it is kept only in args.hf_config")
    shared = _int(hf, "shared_expert_intermediate_size", default=0) if fam.shared_expert else 0
    cfg = {"num_experts": experts, "moe_ffn_hidden_size": expert_ffn, "moe_layer_pattern": pattern,
           "moe_shared_expert_intermediate_size": shared or None, "moe_shared_expert_gate": bool(shared)}
    args = {"num_experts": experts, "moe_ffn_hidden_size": expert_ffn,
            "moe_shared_expert_intermediate_size": shared or None, "moe_shared_expert_gate": bool(shared),
            "moe_layer_freq": 1 if pattern is None else list(pattern), "moe_router_topk": topk,
            "moe_router_pre_softmax": pre_softmax, "moe_router_score_function": "softmax",
            "moe_router_enable_expert_bias": False, "moe_grouped_gemm": False,
            "expert_model_parallel_size": 1, "expert_tensor_parallel_size": 1}
    return cfg, args


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
    if cfg.mtp_num_layers and not cfg.mla:
        problems.append("multi-token-prediction layers without multi-latent attention")
    if cfg.mla and not problems:
        return FAMILIES[hf_deepseek.check_exportable(cfg, args)]
    if problems:
        raise ConvertError(f"the model has {', '.join(problems)}, which none of the supported Hugging Face "
                           f"families ({', '.join(FAMILIES)}) express",
                           "export only Llama/Mistral/Qwen-shaped models (RMSNorm, SwiGLU, RoPE) with --dst-format hf")
    hf = getattr(args, "hf_config", None)
    if isinstance(hf, dict):
        for a in hf.get("architectures") or []:
            fam = FAMILIES.get(a)
            if fam and why_not(fam, cfg) is None:
                return fam
    if cfg.num_experts:
        return _moe_family(cfg)
    key = (cfg.add_qkv_bias, cfg.qk_layernorm)
    return {(True, False): FAMILIES["Qwen2ForCausalLM"], (False, True): FAMILIES["Qwen3ForCausalLM"]}.get(
        key, FAMILIES["LlamaForCausalLM"])


def why_not(fam: Family, cfg: ModelConfig) -> str | None:
    """Pure: what of the model ``fam`` cannot express (None: it expresses it)."""
    if fam.mla != cfg.mla:
        return "multi-latent attention" if cfg.mla else "no multi-latent attention"
    if fam.mla:
        return None
    if fam.moe != bool(cfg.num_experts):
        return "Mixture-of-Experts layers" if cfg.num_experts else "no Mixture-of-Experts layers"
    if cfg.qk_layernorm != fam.qk_norm:
        return "q/k layernorm" if cfg.qk_layernorm else "no q/k layernorm"
    if cfg.add_qkv_bias != fam.qkv_bias and not fam.qkv_bias_flag:
        return "qkv biases" if cfg.add_qkv_bias else "no qkv biases"
    if not fam.moe:
        return None
    shared = bool(cfg.moe_shared_expert_intermediate_size)
    if cfg.moe_router_expert_bias:
        return "a router expert bias (moe_router_enable_expert_bias)"
    if shared and not cfg.moe_shared_expert_gate:
        return "shared experts without a gate (moe_shared_expert_gate)"
    if shared != fam.shared_expert:
        return "shared experts" if shared else "no shared experts"
    if cfg.moe_layer_pattern is not None and not fam.dense_layers:
        return f"dense layers between the MoE layers (moe_layer_freq={list(cfg.moe_layer_pattern)})"
    return None


def _moe_family(cfg: ModelConfig) -> Family:
    """Shared experts: Qwen2-MoE; q/k layernorm: Qwen3-MoE; else Mixtral, or a refusal saying why."""
    name = ("Qwen2MoeForCausalLM" if cfg.moe_shared_expert_intermediate_size else
            "Qwen3MoeForCausalLM" if cfg.qk_layernorm else "MixtralForCausalLM")
    fam = FAMILIES[name]
    problem = why_not(fam, cfg)
    if problem is None:
        return fam
    if name != "MixtralForCausalLM" or not problem.startswith("dense layers"):
        where = "none of the supported Hugging Face MoE families (" + ", ".join(MOE_FAMILIES) + ")"
    else:
        where = (f"{name} (no dense layers; Qwen2-MoE needs gated shared experts and Qwen3-MoE q/k layernorm, "
                 "which the model lacks)")
    raise ConvertError(f"the MoE model has {problem}, which {where} can express",
                       "export it with --dst-format torch_dist or megatron instead of hf")


def hf_from_config(cfg: ModelConfig, args: argparse.Namespace, dtype: torch.dtype) -> dict[str, Any]:
    """``config.json`` for the model: the original HF config when the args carry one, updated."""
    fam = export_family(cfg, args)
    if fam.mla:
        return hf_deepseek.hf_from_config(cfg, args, {v: k for k, v in HF_DTYPES.items()}.get(dtype, "float32"))
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
    if fam.moe:
        hf.update(_moe_to_hf(fam, cfg, args, hf))
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


def _moe_to_hf(fam: Family, cfg: ModelConfig, args: argparse.Namespace, base: dict[str, Any]) -> dict[str, Any]:
    """The MoE keys of ``config.json`` (``base``: the same family's original config, or empty)."""
    topk = int(getattr(args, "moe_router_topk", None) or base.get("num_experts_per_tok") or 2)
    # the router maths is not in the tensors: refuse what the family would compute differently
    if (getattr(args, "moe_router_score_function", None) or "softmax") != "softmax":
        raise ConvertError(f"the MoE router scores with {args.moe_router_score_function}; {fam.architecture} uses "
                           "softmax", "export it with --dst-format torch_dist or megatron instead of hf")
    if not fam.dense_layers and getattr(args, "moe_router_pre_softmax", False):
        raise ConvertError(f"the MoE router takes the softmax before top-k without renormalising "
                           f"(moe_router_pre_softmax); {fam.architecture} renormalises the top-k",
                           "export it with --dst-format torch_dist or megatron instead of hf")
    if not fam.dense_layers:  # Mixtral: experts of intermediate_size
        return {"num_local_experts": cfg.num_experts, "num_experts_per_tok": topk,
                "intermediate_size": cfg.expert_ffn}
    pattern = cfg.moe_layer_pattern or (1,) * cfg.num_layers
    step, only = base.get("decoder_sparse_step", 1), base.get("mlp_only_layers") or []
    if not (isinstance(step, int) and step >= 1 and hf_moe_pattern(cfg.num_layers, step, list(only)) == pattern):
        step, only = 1, [layer for layer, moe in enumerate(pattern) if not moe]
    pre_softmax = getattr(args, "moe_router_pre_softmax", None)
    out: dict[str, Any] = {
        "num_local_experts" if "num_local_experts" in base else "num_experts": cfg.num_experts,
        "num_experts_per_tok": topk, "moe_intermediate_size": cfg.expert_ffn, "decoder_sparse_step": step,
        "mlp_only_layers": list(only),
        "norm_topk_prob": bool(base.get("norm_topk_prob", False)) if pre_softmax is None else not pre_softmax}
    if fam.shared_expert:
        out["shared_expert_intermediate_size"] = cfg.moe_shared_expert_intermediate_size
    if fam.qkv_bias_flag:
        out["qkv_bias"] = cfg.add_qkv_bias
    return out

