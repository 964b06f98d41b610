"""DeepSeek-V2 / V3 (``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``; also configs of their architecture,
e.g. Kimi-K2): multi-latent attention, DeepSeek MoE (dense first layers, shared experts, sigmoid or softmax
routing) and multi-token-prediction layers.

HF stores MTP layer k as decoder layer ``num_hidden_layers + k`` with the extra modules ``enorm``,
``hnorm``, ``eh_proj`` and ``shared_head.norm``, plus copies of the embedding (``embed_tokens``) and
the output head (``shared_head.head``); transformers itself does not load them.

The DeepSeek MoE (``moe_from_hf`` / ``moe_to_hf`` / ``moe_problems``, the router: ``router_args``), its names
(``moe_names``) and the MTP layers (``stack_names``, ``mtp_copies``, ``drop_absent_mtp``) are shared with the
GLM-4.5 family (``models/glm.py``), which puts the same MoE and MTP layers over GQA attention.
"""
from __future__ import annotations

import argparse
import copy
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..config import DEFAULT_DIVISIBLE_BY, ModelConfig, padded_vocab_size
from ..errors import ConvertError
from ..layout.rules import EMBEDDING, MTP_LAYER, OUTPUT
from .base import (
    DENSE_MLP,
    DTYPE_NAMES,
    EXPORT_FIX,
    MLP_NORM,
    Family,
    Imported,
    Name,
    expert_names,
    get,
    structure_problems,
)

# (HF suffix after model.layers.N., logical suffix, part) of an MLA layer's attention
MLA_NAMES: tuple[tuple[str, str, str | None], ...] = (
    ("input_layernorm.weight", "input_layernorm.weight", None),
    ("self_attn.q_proj.weight", "self_attention.linear_q_proj.weight", None),
    ("self_attn.q_a_proj.weight", "self_attention.linear_q_down_proj.weight", None),
    ("self_attn.q_a_layernorm.weight", "self_attention.q_layernorm.weight", None),
    ("self_attn.q_b_proj.weight", "self_attention.linear_q_up_proj.weight", None),
    ("self_attn.kv_a_proj_with_mqa.weight", "self_attention.linear_kv_down_proj.weight", None),
    ("self_attn.kv_a_layernorm.weight", "self_attention.kv_layernorm.weight", None),
    ("self_attn.kv_b_proj.weight", "self_attention.linear_kv_up_proj.weight", None),
    ("self_attn.o_proj.weight", "self_attention.linear_proj.weight", None),
)
SHARED_NAMES: tuple[tuple[str, str, str | None], ...] = (
    ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.linear_fc1.weight", "gate"),
    ("mlp.shared_experts.up_proj.weight", "mlp.shared_experts.linear_fc1.weight", "up"),
    ("mlp.shared_experts.down_proj.weight", "mlp.shared_experts.linear_fc2.weight", None),
)
# an MTP layer's own modules (logical suffix after mtp.layers.K.); its decoder layer is under MTP_LAYER
MTP_NAMES: tuple[tuple[str, str, str | None], ...] = (
    ("enorm.weight", "enorm.weight", None),
    ("hnorm.weight", "hnorm.weight", None),
    ("eh_proj.weight", "eh_proj.weight", None),
    ("shared_head.norm.weight", "final_layernorm.weight", None),
)
MTP_COPIES = (("embed_tokens.weight", EMBEDDING), ("shared_head.head.weight", OUTPUT))
V3, V2 = "DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"
YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}


def moe_names(num_experts: int) -> tuple[Name, ...]:
    return (("mlp.gate.weight", "mlp.router.weight", None),
            ("mlp.gate.e_score_correction_bias", "mlp.router.expert_bias", None),
            *expert_names("mlp", num_experts), *SHARED_NAMES)


def stack_names(cfg: ModelConfig, stack: str, layer: int, attention: tuple[Name, ...]) -> list[Name]:
    """(HF suffix, logical name, part) of every tensor of one decoder or MTP layer with ``attention``'s names
    and DeepSeek's MoE; HF numbers MTP layer k as decoder layer ``num_layers + k`` and stores copies of the
    embedding and the output head with it."""
    moe = cfg.layer_is_moe(stack, layer)
    names = attention + MLP_NORM + (moe_names(cfg.num_experts) if moe else DENSE_MLP)
    if stack == "decoder":
        return [(hf, f"decoder.layers.{layer}.{lg}", part) for hf, lg, part in names]
    copies = [(hf, OUTPUT if name == OUTPUT and not cfg.tied else EMBEDDING, None) for hf, name in MTP_COPIES]
    return ([(hf, f"mtp.layers.{layer}.{lg}", part) for hf, lg, part in MTP_NAMES]
            + [(hf, f"mtp.layers.{layer}.{MTP_LAYER}{lg}", part) for hf, lg, part in names] + copies)


def layer_names(cfg: ModelConfig, stack: str, layer: int) -> list[Name]:
    return stack_names(cfg, stack, layer, MLA_NAMES)


def mtp_copies(cfg: ModelConfig, found: Collection[str]) -> dict[str, list[str]]:
    """The copies of the embedding and the output head stored with each MTP layer, by the key they copy
    (they are compared with it on read, never read as the tensor itself)."""
    out: dict[str, list[str]] = {}
    for k in range(cfg.mtp_num_layers):
        for suffix, name in MTP_COPIES:
            key = f"model.layers.{cfg.num_layers + k}.{suffix}"
            if key in found:
                primary = "lm_head.weight" if name == OUTPUT and not cfg.tied else "model.embed_tokens.weight"
                out.setdefault(primary, []).append(key)
    return out


def drop_absent_mtp(cfg: ModelConfig, args: argparse.Namespace, found: Collection[str],
                    notes: list[str]) -> ModelConfig:
    """The model without its MTP layers when ``config.json`` declares them and the weights hold none."""
    if cfg.mtp_num_layers and f"model.layers.{cfg.num_layers}.eh_proj.weight" not in found:
        notes.append(f"config.json declares {cfg.mtp_num_layers} MTP layers (num_nextn_predict_layers) but the "
                     "weights hold none; converting the model without them")
        args.mtp_num_layers = None
        return cfg.replace(mtp_num_layers=0)
    return cfg


def _rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """(theta, Megatron-LM rope args): plain RoPE, or YaRN as DeepSeek-V3 uses it."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    theta = float(hf.get("rope_theta", params.get("rope_theta", 10000.0)))
    if not scaling:
        return theta, {"rope_type": "rope", "rotary_scaling_factor": 1.0}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "yarn":
        raise ConvertError(f"RoPE scaling {kind!r} of an MLA model has no megatron-core equivalent (MLA knows "
                           "plain RoPE and YaRN)", "convert a model with rope_scaling null or of type yarn")
    return theta, {"rope_type": "yarn", "rotary_scaling_factor": float(scaling.get("factor", 1.0)),
                   "original_max_position_embeddings": int(scaling.get("original_max_position_embeddings", 4096)),
                   **{k: float(scaling.get(k, d)) for k, d in YARN_DEFAULTS.items()}}


def router_args(hf: dict[str, Any], v3: bool, experts: int, topk: int, name: str = "DeepSeek-V3") -> dict[str, Any]:
    """Megatron-LM router args for DeepSeek's routing. V3 (and ``name``, a family routing as V3 does):
    sigmoid scores, a correction bias for the choice, group-limited top-k (group score: sum of the top 2),
    renormalised, scaled. V2: softmax, greedy top-k, scaled, never renormalised."""
    groups, group_topk = hf.get("n_group"), hf.get("topk_group")
    scale = float(get(hf, "routed_scaling_factor", 1.0))
    args: dict[str, Any] = {"moe_router_topk": topk, "moe_router_topk_scaling_factor": scale,
                            "moe_router_dtype": "fp32", "moe_router_load_balancing_type": "seq_aux_loss"}
    if v3:
        if not hf.get("norm_topk_prob", True) and topk > 1:
            raise ConvertError("norm_topk_prob=false with sigmoid routing: megatron-core renormalises the top-k "
                               "sigmoid scores", f"convert a {name} config with norm_topk_prob true")
        args.update(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                    moe_router_pre_softmax=False)
        if groups and int(groups) > 1:
            if topk % int(group_topk) or topk // int(group_topk) != 2:
                raise ConvertError(f"group-limited routing with top-k {topk} over topk_group={group_topk}: "
                                   f"megatron-core scores a group by its top (top-k / topk_group) experts, {name} "
                                   "by its top 2",
                                   "convert a config where num_experts_per_tok / topk_group == 2")
            args.update(moe_router_num_groups=int(groups), moe_router_group_topk=int(group_topk))
    else:
        method = hf.get("topk_method", "greedy")
        if method != "greedy":
            raise ConvertError(f"DeepSeek-V2 topk_method={method!r}: megatron-core scores a group by the sum of its "
                               "top experts, DeepSeek-V2 by its best one", "convert a config with topk_method greedy")
        args.update(moe_router_score_function="softmax", moe_router_enable_expert_bias=False,
                    moe_router_pre_softmax=True)
    if experts % max(1, int(groups or 1)):
        raise ConvertError(f"n_group={groups} does not divide n_routed_experts={experts}",
                           "fix n_group in config.json")
    return args


def moe_from_hf(hf: dict[str, Any], layers: int, ffn: int, v3: bool,
                name: str = "DeepSeek-V3") -> tuple[dict[str, Any], dict[str, Any]]:
    """(``ModelConfig`` fields, Megatron-LM args) of DeepSeek's MoE as ``config.json`` states it: layer l is MoE
    iff l >= first_k_dense_replace (and l % moe_layer_freq == 0), experts of moe_intermediate_size, an ungated
    shared expert of n_shared_experts experts, the router of ``router_args``; empty without routed experts."""
    experts = int(get(hf, "n_routed_experts", 0))
    if not experts:
        return {}, {}
    dense = int(get(hf, "first_k_dense_replace", 0))
    freq = int(get(hf, "moe_layer_freq", 1))
    pattern = tuple(int(layer >= dense and layer % freq == 0) for layer in range(layers))
    topk = int(get(hf, "num_experts_per_tok", 1))
    expert_ffn = int(get(hf, "moe_intermediate_size", ffn))
    shared = int(get(hf, "n_shared_experts", 0)) * expert_ffn
    moe_cfg = {"num_experts": experts, "moe_ffn_hidden_size": expert_ffn,
               "moe_layer_pattern": None if all(pattern) else pattern,
               "moe_shared_expert_intermediate_size": shared or None, "moe_shared_expert_gate": False,
               "moe_router_expert_bias": v3}
    moe_args = {"num_experts": experts, "moe_ffn_hidden_size": expert_ffn,
                "moe_layer_freq": 1 if all(pattern) else list(pattern),
                "moe_shared_expert_intermediate_size": shared or None, "moe_shared_expert_gate": False,
                "moe_grouped_gemm": False, "expert_model_parallel_size": 1, "expert_tensor_parallel_size": 1,
                **router_args(hf, v3, experts, topk, name)}
    return moe_cfg, moe_args


def config_from_hf(hf: dict[str, Any], architecture: str,
                   vocab_divisible_by: int | None) -> tuple[ModelConfig, argparse.Namespace, list[str]]:
    """Model config, Megatron-LM args and notes of a DeepSeek-V2/V3 ``config.json``."""
    v3 = architecture == V3
    try:
        heads, hidden = int(hf["num_attention_heads"]), int(hf["hidden_size"])
        layers, ffn, vocab = int(hf["num_hidden_layers"]), int(hf["intermediate_size"]), int(hf["vocab_size"])
        kv_lora, nope = int(hf["kv_lora_rank"]), int(hf["qk_nope_head_dim"])
        rope_dim, v_dim = int(hf["qk_rope_head_dim"]), int(hf["v_head_dim"])
    except KeyError as e:
        raise ConvertError(f"config.json lacks {e.args[0]}", "use the config.json saved with the model") from None
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ConvertError("attention_bias / mlp_bias = true: megatron-core's MLA and MoE layers have no such biases",
                           "convert a model without them")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConvertError(f"hidden_act={hf['hidden_act']!r} is not supported", "only SiLU-gated (SwiGLU) MLPs convert")
    if v3 and hf.get("rope_interleave") is False:
        raise ConvertError("rope_interleave=false: megatron-core's MLA always de-interleaves the RoPE dimensions",
                           "convert a config with rope_interleave true (as DeepSeek releases have)")
    q_lora = hf.get("q_lora_rank")
    mtp = int(get(hf, "num_nextn_predict_layers", 0)) if v3 else 0
    theta, rope_args = _rope(hf)
    divisible = vocab_divisible_by or DEFAULT_DIVISIBLE_BY
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        str(hf.get("dtype") or hf.get("torch_dtype")), torch.float32)
    if hf.get("quantization_config"):  # FP8 releases: dequantized on read to bf16 unless --dtype says otherwise
        dtype = torch.bfloat16
    max_pos = int(get(hf, "max_position_embeddings", 4096))
    moe_cfg, moe_args = moe_from_hf(hf, layers, ffn, v3)
    cfg = ModelConfig(
        num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn, num_attention_heads=heads,
        num_query_groups=heads, kv_channels=hidden // heads, swiglu=True, normalization="RMSNorm",
        add_bias_linear=False, add_qkv_bias=False,
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings"),
        vocab_size=vocab, make_vocab_size_divisible_by=divisible, position_embedding_type="rope",
        max_position_embeddings=max_pos, qk_layernorm=True, spec="te", multi_latent_attention=True,
        q_lora_rank=int(q_lora) if q_lora else None, kv_lora_rank=kv_lora, qk_head_dim=nope,
        qk_pos_emb_head_dim=rope_dim, v_head_dim=v_dim, mtp_num_layers=mtp, **moe_cfg)
    args = argparse.Namespace(
        num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn, num_attention_heads=heads,
        group_query_attention=False, num_query_groups=heads, kv_channels=cfg.kv_channels, swiglu=True,
        normalization="RMSNorm", norm_epsilon=float(get(hf, "rms_norm_eps", 1e-6)), add_bias_linear=False,
        add_qkv_bias=False, qk_layernorm=True,
        untie_embeddings_and_output_weights=cfg.untie_embeddings_and_output_weights, vocab_size=vocab,
        make_vocab_size_divisible_by=divisible, padded_vocab_size=padded_vocab_size(vocab, divisible, 1),
        position_embedding_type="rope", use_rotary_position_embeddings=True, rotary_base=theta, rotary_percent=1.0,
        max_position_embeddings=max_pos, seq_length=max_pos, hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1, transformer_impl="transformer_engine", tokenizer_type="HuggingFaceTokenizer",
        multi_latent_attention=True, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=kv_lora, qk_head_dim=nope,
        qk_pos_emb_head_dim=rope_dim, v_head_dim=v_dim, mtp_num_layers=mtp or None,
        **rope_args, **moe_args)
    return cfg, args, []


def export_problems(cfg: ModelConfig, args: argparse.Namespace) -> list[str]:
    """What of an MLA model DeepSeek's configs cannot express."""
    problems = []
    if cfg.qk_layernorm is False:
        problems.append("no q/kv layernorms (DeepSeek always has q_a_layernorm / kv_a_layernorm)")
    return problems + moe_problems(cfg, args)


def moe_problems(cfg: ModelConfig, args: argparse.Namespace) -> list[str]:
    """What of an MoE model DeepSeek's MoE keys (first_k_dense_replace, n_shared_experts, ...) cannot express."""
    problems = []
    if cfg.num_experts:
        pattern = cfg.moe_layer_pattern or (1,) * cfg.num_layers
        dense = pattern.index(1) if 1 in pattern else cfg.num_layers
        if any(pattern[dense:]) and not all(pattern[dense:]):
            problems.append(f"MoE layers interleaved with dense ones (moe_layer_freq={list(pattern)}): DeepSeek has "
                            "first_k_dense_replace dense layers, then MoE layers only")
        if cfg.moe_shared_expert_gate:
            problems.append("a gated shared expert")
        shared = cfg.moe_shared_expert_intermediate_size or 0
        if shared % cfg.expert_ffn:
            problems.append(f"a shared-expert size {shared} that is no multiple of the expert size {cfg.expert_ffn}")
    sigmoid = getattr(args, "moe_router_score_function", "softmax") == "sigmoid"
    if cfg.num_experts and sigmoid != cfg.moe_router_expert_bias:
        problems.append("sigmoid routing without an expert bias" if sigmoid else "an expert bias with softmax routing")
    return problems


def architecture_of(cfg: ModelConfig, args: argparse.Namespace) -> str:
    """The DeepSeek architecture an MLA model exports as: V3 unless it routes as V2 does."""
    sigmoid = getattr(args, "moe_router_score_function", "softmax") == "sigmoid"
    return V3 if (sigmoid or cfg.q_lora_rank is not None or cfg.mtp_num_layers or not cfg.num_experts) else V2


def moe_to_hf(cfg: ModelConfig, args: argparse.Namespace) -> dict[str, Any]:
    """DeepSeek's MoE keys of ``config.json`` for an MoE model (``moe_problems`` says what they cannot express)."""
    pattern = cfg.moe_layer_pattern or (1,) * cfg.num_layers
    groups = getattr(args, "moe_router_num_groups", None)
    return {"n_routed_experts": cfg.num_experts, "moe_intermediate_size": cfg.expert_ffn,
            "n_shared_experts": (cfg.moe_shared_expert_intermediate_size or 0) // cfg.expert_ffn,
            "num_experts_per_tok": int(getattr(args, "moe_router_topk", 2) or 2),
            "first_k_dense_replace": pattern.index(1),
            "routed_scaling_factor": float(getattr(args, "moe_router_topk_scaling_factor", None) or 1.0),
            "n_group": int(groups) if groups else 1,
            "topk_group": int(getattr(args, "moe_router_group_topk", None) or 1) if groups else 1}


def hf_from_config(cfg: ModelConfig, args: argparse.Namespace, base: dict[str, Any] | None,
                   dtype_name: str) -> dict[str, Any]:
    """``config.json`` of an MLA model (``base``, the source's DeepSeek config, updated, when of that architecture)."""
    arch = architecture_of(cfg, args)
    same = isinstance(base, dict) and arch in (base.get("architectures") or [])
    hf: dict[str, Any] = copy.deepcopy(base) if same else {}
    hf.update({
        "architectures": [arch], "model_type": hf.get("model_type") or ("deepseek_v3" if arch.startswith(
            "DeepseekV3") else "deepseek_v2"), "hidden_act": "silu", "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_attention_heads,
        "q_lora_rank": cfg.q_lora_rank, "kv_lora_rank": cfg.kv_lora_rank, "qk_nope_head_dim": cfg.qk_head_dim,
        "qk_rope_head_dim": cfg.qk_pos_emb_head_dim, "v_head_dim": cfg.v_head_dim,
        "head_dim": cfg.qk_pos_emb_head_dim, "qk_head_dim": cfg.q_head_dim, "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": cfg.tied, "max_position_embeddings": int(cfg.max_position_embeddings or 4096),
        "attention_bias": False, "rms_norm_eps": float(getattr(args, "norm_epsilon", 1e-6) or 1e-6),
        "torch_dtype": dtype_name, "dtype": dtype_name})
    if arch == V3:
        hf.update(num_nextn_predict_layers=cfg.mtp_num_layers, rope_interleave=True)
    if cfg.num_experts:
        hf.update(moe_to_hf(cfg, args), moe_layer_freq=1)
        if arch == V3:
            hf.update(norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc")
        else:
            hf.update(norm_topk_prob=False, topk_method="greedy")
    else:  # every layer dense
        hf.update(n_routed_experts=None, first_k_dense_replace=cfg.num_layers,
                  moe_intermediate_size=cfg.ffn_hidden_size, n_shared_experts=0)
    if not same:
        hf["rope_theta"] = float(getattr(args, "rotary_base", 10000.0) or 10000.0)
        if getattr(args, "rope_type", None) == "yarn":
            original = getattr(args, "original_max_position_embeddings", None) or 4096
            hf["rope_scaling"] = {"type": "yarn", "factor": float(args.rotary_scaling_factor),
                                  "original_max_position_embeddings": int(original),
                                  **{k: float(getattr(args, k, d)) for k, d in YARN_DEFAULTS.items()}}
    return hf


@dataclass(frozen=True, kw_only=True)
class DeepSeek(Family):
    architecture: str
    model_type: str
    scope: ClassVar[str] = "DeepSeek-V2/V3 configs"

    def from_hf(self, hf: dict[str, Any], vocab_divisible_by: int | None) -> Imported:
        cfg, args, notes = config_from_hf(hf, self.architecture, vocab_divisible_by)
        return Imported(cfg=cfg, args=args, notes=notes)

    def to_hf(self, cfg: ModelConfig, args: argparse.Namespace, base: dict[str, Any] | None,
              dtype: torch.dtype) -> dict[str, Any]:
        return hf_from_config(cfg, args, base, DTYPE_NAMES.get(dtype, "float32"))

    def affinity(self, cfg: ModelConfig) -> int:
        return 4 if cfg.mla else 0

    def why_not(self, cfg: ModelConfig, args: argparse.Namespace) -> str | None:
        if not cfg.mla:
            return "no multi-latent attention"
        problems = structure_problems(cfg) or export_problems(cfg, args)
        if problems:
            return "; ".join(problems)
        arch = architecture_of(cfg, args)
        return None if arch == self.architecture else f"the routing and attention of {arch}"

    def refusal(self, problem: str) -> ConvertError:
        return ConvertError(f"the MLA model has {problem}, which {self.scope} cannot express", EXPORT_FIX)

    def layer_names(self, cfg: ModelConfig, stack: str, layer: int) -> list[Name]:
        return layer_names(cfg, stack, layer)

    def as_stored(self, cfg: ModelConfig, args: argparse.Namespace, found: Collection[str],
                  notes: list[str]) -> ModelConfig:
        return drop_absent_mtp(cfg, args, found, notes)

    def stored_copies(self, cfg: ModelConfig, found: Collection[str]) -> dict[str, list[str]]:
        return mtp_copies(cfg, found)


FAMILIES = (DeepSeek(architecture=V3, model_type="deepseek_v3"), DeepSeek(architecture=V2, model_type="deepseek_v2"))
