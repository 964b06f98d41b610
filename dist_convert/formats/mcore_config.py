"""Model configs stored as megatron-core ``TransformerConfig`` fields (NeMo 2's ``model.yaml``/``io.json``
``config``, Megatron-Bridge's ``run_config.yaml`` ``model:``), read into Megatron-LM ``args`` (the names
the rest of dist_convert speaks) and written back. A setting is read under the names it declares
(``config.read_names``); ``FIELDS`` maps the rest: TransformerConfig name -> args name.
"""
from __future__ import annotations

import argparse
from collections.abc import Collection
from typing import Any

import torch

from ..config import RECORDS, ModelConfig, read_names
from ..errors import ConvertError
from ..features import Linear, Llama3
from ..features.audit import UNCONVERTED
from ..features.base import SETTING
from ..features.expressed import ANY, scaling_settings
from ..layout.topology import Layout

# megatron-core names read by hand in args_from_fields (no args name holds the value as it stands)
BY_HAND = ("activation_func",)


def renamed_fields() -> dict[str, str]:
    """Each feature record's megatron-core names that are not its Megatron-LM args names -> the args name they are
    read under (the first ``arg`` of the setting declaring them), but ``BY_HAND``."""
    return {c: f.metadata["arg"][0] for cls in RECORDS.values() for _, f in cls.leaf_fields()
            for c in f.metadata.get("config", ()) if c not in f.metadata["arg"] and c not in BY_HAND}


# TransformerConfig / GPTConfig field -> Megatron-LM args name where a setting's own names do not say it: the fields
# no model setting declares (parallel sizes, precision, the training knobs a carried config keeps), the norm epsilon's
# older args name, the MoE layer list (kept a list, as Megatron-LM's args hold it) and the records' renamed settings.
# Every other setting is read under its megatron-core name (``config.read_names``, in ``args_from_fields``).
FIELDS: dict[str, str] = {
    **{k: k for k in (
        "seq_length", "hidden_dropout", "attention_dropout", "moe_grouped_gemm", "moe_router_load_balancing_type",
        "moe_aux_loss_coeff", "moe_token_dispatcher_type", "tensor_model_parallel_size",
        "pipeline_model_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size",
        "virtual_pipeline_model_parallel_size", "pipeline_model_parallel_layout", "bf16", "fp16", "moe_layer_freq")},
    "layernorm_epsilon": "norm_epsilon",
    "num_layers_in_first_pipeline_stage": "decoder_first_pipeline_num_layers",
    "num_layers_in_last_pipeline_stage": "decoder_last_pipeline_num_layers",
    **renamed_fields(),
}
# the parallel fields a carried config gets from the target layout
PARALLEL = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
            "expert_tensor_parallel_size", "virtual_pipeline_model_parallel_size",
            "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage", "pipeline_model_parallel_layout")
REQUIRED = ("num_layers", "hidden_size", "num_attention_heads")
_DTYPES = {"torch.float32": torch.float32, "torch.bfloat16": torch.bfloat16, "torch.float16": torch.float16}
# the activation a serialised activation_func names (its last dotted part) -> MLP.activation
ACTIVATION_NAMES = {"silu": "silu", "swish": "silu", "gelu": "gelu", "fast_gelu": "gelu_tanh",
                    "openai_gelu": "gelu_tanh", "gelu_tanh": "gelu_tanh", "quick_gelu": "quick_gelu",
                    "squared_relu": "squared_relu"}
# MLP.activation -> the callable a config names for it
ACTIVATION_TARGETS = {"silu": "torch.nn.functional.silu", "gelu": "torch.nn.functional.gelu",
                      "gelu_tanh": "megatron.core.transformer.utils.openai_gelu",
                      "quick_gelu": "megatron.core.fusions.fused_bias_geglu.quick_gelu",
                      "squared_relu": "megatron.core.activations.squared_relu"}
# Settings a megatron-core model's config holds under megatron-core's own names, written where not plain (NeMo's
# model_config.yaml too: NeMo hands them to TransformerConfig as they stand)
PASSED = ("position.interleaved", "position.seq_len_interpolation", "attention.qk_l2_norm", "attention.softmax_scale",
          "attention.softmax_type", "attention.window", "attention.window_skip_freq", "attention.output_gate",
          "mlp.glu_linear_offset", "mlp.clamp")


def every_setting(record: str, but: dict[str, str] | None = None) -> dict[str, Any]:
    """``record.field``: ANY for each of a record's settings (kind ``SETTING``), but those named in ``but`` (each with
    why a provider cannot write it)."""
    return {f"{record}.{f.name}": ANY for f in RECORDS[record].all_fields()
            if f.metadata.get("kind") == SETTING and f.name not in (but or {})}


# What a megatron-core TransformerConfig subclass written from the model config alone (Megatron-Bridge's
# GPTModelProvider, NeMo 2's GPTConfig) expresses: every attention, norm, MLP, RoPE and MoE setting megatron-core's
# GPTModel has, and multi-token prediction; not what only other model classes build (MLA, Mamba, Gated DeltaNet,
# T5, Gemma 3's sandwich norms, local RoPE base and embedding scale)
PROVIDER_EXPRESSES: dict[str, Any] = {
    **dict.fromkeys(PASSED, ANY), **{f"position.{f}": ANY for f in ("base", "percent")},
    "position.kind": {"rope", "learned_absolute", "none"}, **scaling_settings("llama3"),
    **every_setting("norm", but={"post_norms": "Gemma 3's sandwich norms: its own provider's layer spec"}),
    "attention.qk_norm": ANY, "mlp.gated": ANY, "mlp.activation": ANY,
    "add_bias_linear": ANY, "add_qkv_bias": ANY, "moe": ANY, "mtp": ANY, **every_setting("moe"),
}


# MLATransformerConfig's RoPE fields (Megatron-LM's args names are the same), as the Position record writes them
MLA_ROPE = ("position_embedding_type", "rotary_base", "rope_type", "rotary_scaling_factor", "mscale", "mscale_all_dim",
            "original_max_position_embeddings", "beta_fast", "beta_slow")
# What Megatron-Bridge's MLAModelProvider adds: multi-latent attention with YaRN RoPE, and DeepSeek sparse attention
MLA_PROVIDER_EXPRESSES: dict[str, Any] = {
    **PROVIDER_EXPRESSES, "mla": ANY, "dsa": ANY, "position.kind": {"rope", "yarn"},
    **scaling_settings("llama3", "yarn", "mla_softmax"),
    **every_setting("dsa")}


# What Megatron-Bridge's HybridModelProvider (megatron-core's HybridModel) expresses: a layer pattern of Mamba2,
# Gated DeltaNet (TransformerConfig's linear_* sizes), attention, MLP and MoE layers with GPTModelProvider's
# attention, norm, MLP and MoE settings and multi-token-prediction depths of one pattern; not Llama 3's RoPE scaling
# (no rope_scaling field) nor multi-latent attention (no MLATransformerConfig fields)
HYBRID_PROVIDER_EXPRESSES: dict[str, Any] = {
    **{k: v for k, v in PROVIDER_EXPRESSES.items() if not k.startswith("position.scaling")},
    **scaling_settings(), "mamba": ANY, "gdn": ANY}


def provider_expresses(cfg: ModelConfig) -> dict[str, Any]:
    """What the provider a Bridge run_config.yaml is written with expresses (HybridModelProvider for a HybridModel,
    MLAModelProvider for MLA models)."""
    if cfg.mamba is not None:
        return HYBRID_PROVIDER_EXPRESSES
    return MLA_PROVIDER_EXPRESSES if cfg.mla is not None else PROVIDER_EXPRESSES


def callable_name(value: Any) -> str | None:
    """The dotted name a serialised callable or class stands for (``{_target_: torch.float32, _call_: false}``
    in YAML, the ``pyref`` of a Fiddle graph already resolved by the caller), else None."""
    if isinstance(value, dict):
        value = value.get("_target_")
    return value if isinstance(value, str) else None


def args_from_fields(fields: dict[str, Any], where: str, fix: str) -> argparse.Namespace:
    """Megatron-LM args from TransformerConfig fields: every field a feature record reads (``features.audit``) under
    its Megatron-LM name, the activation from its callable; refuses a config without the model's size."""
    missing = [k for k in REQUIRED if fields.get(k) is None]
    if missing:
        raise ConvertError(f"{where} lacks {', '.join(missing)}", fix)
    args = argparse.Namespace(**{name: fields[k] for k, name in FIELDS.items() if fields.get(k) is not None})
    read = read_names()
    for k, value in fields.items():  # the settings the records read, by their megatron-core names
        if k in read and k not in FIELDS and value is not None and not isinstance(value, dict):
            setattr(args, k, tuple(value) if isinstance(value, list) else value)
    for k in UNCONVERTED:
        if fields.get(k) is not None:
            setattr(args, k, fields[k])
    heads = int(fields["num_attention_heads"])
    args.num_query_groups = int(fields.get("num_query_groups") or heads)
    args.group_query_attention = args.num_query_groups != heads
    if "share_embeddings_and_output_weights" in fields:
        args.untie_embeddings_and_output_weights = not fields["share_embeddings_and_output_weights"]
    gated = bool(fields.get("gated_linear_unit", False))
    named = (callable_name(fields.get("activation_func")) or "").rsplit(".", 1)[-1]
    activation = ACTIVATION_NAMES.get(named or ("silu" if gated else "gelu"))
    if activation is None:
        raise ConvertError(f"{where}: activation_func {named} is not one dist_convert knows",
                           f"only {', '.join(sorted(ACTIVATION_NAMES))} convert")
    args.swiglu = gated and activation != "quick_gelu"
    args.quick_geglu = gated and activation == "quick_gelu"
    args.glu_activation = activation if gated else "silu"
    args.squared_relu = not gated and activation == "squared_relu"
    args.openai_gelu = not gated and activation == "gelu_tanh"
    if not gated and activation in ("silu", "quick_gelu"):
        raise ConvertError(f"{where}: an ungated MLP with activation {activation} is not one megatron-core's "
                           "Megatron-LM arguments say", "convert a model with a gated MLP or a gelu / squared_relu one")
    if fields.get("layernorm_zero_centered_gamma"):
        args.apply_layernorm_1p = args.layernorm_zero_centered_gamma = True
    rotary = fields.get("rotary_base")
    if isinstance(rotary, (list, tuple)):  # Megatron-Bridge's Gemma: (local, global)
        args.rotary_base_local, args.rotary_base = (float(x) for x in rotary)
    args.max_position_embeddings = fields.get("max_position_embeddings") or fields.get("seq_length")
    dtype = _DTYPES.get(callable_name(fields.get("params_dtype")) or "")
    if dtype is None:
        dtype = torch.bfloat16 if fields.get("bf16") else torch.float16 if fields.get("fp16") else torch.float32
    args.params_dtype = dtype
    args.layernorm_epsilon = args.norm_epsilon = float(fields.get("layernorm_epsilon") or 1e-5)
    args.normalization = str(fields.get("normalization") or "LayerNorm")
    args.position_embedding_type = str(fields.get("position_embedding_type") or "learned_absolute")
    args.add_bias_linear = bool(fields.get("add_bias_linear", True))
    args.add_qkv_bias = bool(fields.get("add_qkv_bias", False))
    args.transformer_impl = "local"  # the stored keys decide (dist_keys.spec_from_keys)
    return args


def passed_fields(cfg: ModelConfig, kept: Collection[str] = ()) -> dict[str, Any]:
    """The ``PASSED`` settings under their megatron-core names (lists for tuples), where not plain or named in
    ``kept`` (a source config that had them)."""
    names = {key: name for name, key in read_names().items() if key in PASSED}
    return {names[s.key]: list(s.value) if isinstance(s.value, tuple) else s.value for s in cfg.settings()
            if s.key in PASSED and (s.value != s.plain or names[s.key] in kept)}


def transformer_fields(cfg: ModelConfig) -> dict[str, Any]:
    """The TransformerConfig / GPTModelProvider fields of a model written from its config alone (what
    ``PROVIDER_EXPRESSES`` declares), as a Bridge run_config.yaml or a NeMo 2 config holds them."""
    pos, moe = cfg.position, cfg.moe
    out: dict[str, Any] = {
        "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size, "ffn_hidden_size": cfg.ffn_hidden_size,
        "num_attention_heads": cfg.num_attention_heads, "num_query_groups": cfg.num_query_groups,
        "kv_channels": cfg.kv_channels, "gated_linear_unit": cfg.mlp.gated,
        "activation_func": {"_call_": False, "_target_": ACTIVATION_TARGETS[cfg.mlp.activation]},
        "normalization": cfg.norm.kind, "layernorm_epsilon": cfg.norm.eps,
        "layernorm_zero_centered_gamma": cfg.norm.zero_centered_gamma,
        "apply_residual_connection_post_layernorm": cfg.norm.residual_post_norm,
        "add_bias_linear": cfg.add_bias_linear, "add_qkv_bias": cfg.add_qkv_bias,
        "qk_layernorm": cfg.attention.qk_norm, "share_embeddings_and_output_weights": cfg.tied,
        "position_embedding_type": pos.kind, "rotary_base": pos.base, "rotary_percent": pos.percent,
        "rotary_interleaved": pos.interleaved, "rope_scaling": isinstance(pos.scaling, Llama3),
        "rope_scaling_factor": pos.scaling.factor if isinstance(pos.scaling, (Llama3, Linear)) else 1.0,
        "vocab_size": cfg.vocab_size}
    out.update(passed_fields(cfg))
    if cfg.mtp is not None:
        out["mtp_num_layers"] = cfg.mtp.num_layers
    if moe is not None:
        out.update({"num_moe_experts" if k == "num_experts" else k: (list(v) if isinstance(v, tuple) else v)
                    for k, v in moe.to_args().items() if v is not None})
        out["moe_ffn_hidden_size"] = cfg.expert_ffn
    if cfg.mla is not None:  # MLATransformerConfig's fields: its sizes, its RoPE, DeepSeek sparse attention
        rope = pos.to_args()
        out.update(cfg.mla.to_args(), **{k: rope[k] for k in MLA_ROPE if rope.get(k) is not None})
        if cfg.dsa is not None:
            out.update(cfg.dsa.to_args())
    return out


def fields_for_target(fields: dict[str, Any], cfg: ModelConfig, layout: Layout,
                      dtype: torch.dtype | None) -> dict[str, Any]:
    """``fields`` (a carried config) with the target's layout and, after a cast, its dtype fields."""
    out = dict(fields)
    out.update(tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
               num_layers_in_first_pipeline_stage=layout.first, num_layers_in_last_pipeline_stage=layout.last,
               virtual_pipeline_model_parallel_size=layout.vpp, pipeline_model_parallel_layout=layout.pipeline_layout)
    if cfg.num_experts:
        out.update(expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.expert_tp)
    elif "expert_model_parallel_size" in out:
        out.update(expert_model_parallel_size=1)
    out["make_vocab_size_divisible_by"] = cfg.make_vocab_size_divisible_by
    if cfg.dsa is not None:
        out["sequence_parallel"] = cfg.needs_sequence_parallel(layout.tp)
    if dtype is not None:
        out.update(bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)
        if isinstance(out.get("params_dtype"), dict):
            out["params_dtype"] = {**out["params_dtype"], "_target_": str(dtype)}
    if layout.pp > 1 and not out.get("pipeline_dtype"):  # megatron-core's config requires it with PP
        params = callable_name(out.get("params_dtype")) or str(dtype or torch.float32)
        out["pipeline_dtype"] = {"_call_": False, "_target_": params}
    return out
