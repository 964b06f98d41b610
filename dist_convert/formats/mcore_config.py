"""Model configs stored as megatron-core ``TransformerConfig`` fields (NeMo 2's ``model.yaml``/``io.json``
``config``, Megatron-Bridge's ``run_config.yaml`` ``model:``), read into Megatron-LM ``args`` (the names
the rest of dist_convert speaks) and written back. One table: TransformerConfig name -> args name.
"""
from __future__ import annotations

import argparse
from typing import Any

import torch

from ..config import ModelConfig
from ..errors import ConvertError
from ..layout.topology import Layout

# TransformerConfig / GPTConfig field -> Megatron-LM args name (same name unless given)
FIELDS: dict[str, str] = {
    **{k: k for k in (
        "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
        "normalization", "add_bias_linear", "add_qkv_bias", "position_embedding_type", "rotary_base",
        "rotary_percent", "rotary_interleaved", "qk_layernorm", "make_vocab_size_divisible_by", "vocab_size",
        "seq_length", "hidden_dropout", "attention_dropout", "rope_scaling_factor", "moe_ffn_hidden_size",
        "moe_router_topk", "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_layer_freq",
        "moe_router_enable_expert_bias", "moe_router_pre_softmax", "moe_router_score_function",
        "moe_router_topk_scaling_factor", "moe_grouped_gemm", "moe_router_load_balancing_type",
        "moe_aux_loss_coeff", "moe_token_dispatcher_type", "tensor_model_parallel_size",
        "pipeline_model_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size",
        "virtual_pipeline_model_parallel_size", "pipeline_model_parallel_layout", "multi_latent_attention",
        "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "mtp_num_layers",
        "bf16", "fp16")},
    "num_moe_experts": "num_experts",
    "layernorm_epsilon": "norm_epsilon",
    "gated_linear_unit": "swiglu",
    "rope_scaling": "use_rope_scaling",
    "num_layers_in_first_pipeline_stage": "decoder_first_pipeline_num_layers",
    "num_layers_in_last_pipeline_stage": "decoder_last_pipeline_num_layers",
}
# the parallel fields a carried config gets from the target layout
PARALLEL = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
            "expert_tensor_parallel_size", "virtual_pipeline_model_parallel_size",
            "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage", "pipeline_model_parallel_layout")
REQUIRED = ("num_layers", "hidden_size", "num_attention_heads")
_DTYPES = {"torch.float32": torch.float32, "torch.bfloat16": torch.bfloat16, "torch.float16": torch.float16}
_GATED_ACTIVATIONS = ("silu", "swish")
_TANH_GELU = ("fast_gelu", "openai_gelu", "gelu_tanh")  # megatron-core's tanh-approximated GELUs


def _target(value: Any) -> str | None:
    """The dotted name a serialised callable or class stands for (``{_target_: torch.float32, _call_: false}``
    in YAML, the ``pyref`` of a Fiddle graph already resolved by the caller), else None."""
    if isinstance(value, dict):
        value = value.get("_target_")
    return value if isinstance(value, str) else None


def args_from_fields(fields: dict[str, Any], where: str, fix: str) -> argparse.Namespace:
    """Megatron-LM args from TransformerConfig fields; refuses a config without the model's size."""
    missing = [k for k in REQUIRED if fields.get(k) is None]
    if missing:
        raise ConvertError(f"{where} lacks {', '.join(missing)}", fix)
    args = argparse.Namespace(**{name: fields[k] for k, name in FIELDS.items() if fields.get(k) is not None})
    heads = int(fields["num_attention_heads"])
    args.num_query_groups = int(fields.get("num_query_groups") or heads)
    args.group_query_attention = args.num_query_groups != heads
    if "share_embeddings_and_output_weights" in fields:
        args.untie_embeddings_and_output_weights = not fields["share_embeddings_and_output_weights"]
    args.swiglu = bool(fields.get("gated_linear_unit", False))
    activation = (_target(fields.get("activation_func")) or "").rsplit(".", 1)[-1]
    if args.swiglu and activation in _TANH_GELU:
        args.glu_activation = "gelu_tanh"  # GeGLU (Gemma)
    elif args.swiglu and activation and activation not in _GATED_ACTIVATIONS:
        raise ConvertError(f"{where}: a gated MLP with activation {activation} is not supported",
                           "only SwiGLU (gated silu), GeGLU (gated tanh-GELU) and ungated MLPs convert")
    if fields.get("layernorm_zero_centered_gamma"):
        args.apply_layernorm_1p = args.layernorm_zero_centered_gamma = True
    rotary = fields.get("rotary_base")
    if isinstance(rotary, (list, tuple)):  # Megatron-Bridge's Gemma: (local, global)
        args.rotary_base_local, args.rotary_base = (float(x) for x in rotary)
    for name in ("window_size", "interleaved_attn_pattern", "softmax_scale"):
        if fields.get(name) is not None:
            value = fields[name]
            setattr(args, name, tuple(value) if isinstance(value, list) else value)
    args.max_position_embeddings = fields.get("max_position_embeddings") or fields.get("seq_length")
    dtype = _DTYPES.get(_target(fields.get("params_dtype")) or "")
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
    if dtype is not None:
        out.update(bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)
        if isinstance(out.get("params_dtype"), dict):
            out["params_dtype"] = {**out["params_dtype"], "_target_": str(dtype)}
    if layout.pp > 1 and not out.get("pipeline_dtype"):  # megatron-core's config requires it with PP
        params = _target(out.get("params_dtype")) or str(dtype or torch.float32)
        out["pipeline_dtype"] = {"_call_": False, "_target_": params}
    return out
