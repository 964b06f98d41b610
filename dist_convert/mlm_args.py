"""The Megatron-LM ``args`` a target carries: complete enough that Megatron-LM and Megatron-Bridge load it.

A checkpoint's ``args`` (an ``argparse.Namespace``) is read by:

* ``L``: Megatron-LM ``load_args_from_checkpoint`` (``--use-checkpoint-args``; checkpointing.py), which
  copies the model, tokenizer and parallel fields it names into the run's args;
* ``C``: Megatron-LM ``check_checkpoint_args`` (at every load, unless ``--finetune``);
* ``R``: Megatron-LM ``load_checkpoint`` / ``_load_base_checkpoint`` (parallel sizes, world and
  data-parallel sizes, whether optimizer and RNG state were saved, consumed samples);
* ``B``: Megatron-Bridge 0.6.2 ``training.model_load_save.load_megatron_model`` for Megatron-LM
  checkpoints: ``mlm_compat.arguments._transformer_config_from_args`` (attribute reads without a
  default; every ``TransformerConfig`` field present in the args is passed on), ``mlm_compat.model.
  _gpt_provider`` / ``_get_model`` and ``_tokenizer_config_from_args``.

``ARGS`` lists every field those readers take, with Megatron-LM 0.19's argparse default (what
``parse_args`` gives, after ``validate_args`` where it derives a value). ``complete_args`` is a pure
function: it keeps every field the source had (but ``LEGACY_ORIGIN_ARGS``: where a model came from travels in
its ``datamodel.Origin``, never in args), fills the missing ones from the table, and sets the
model fields from the ``ModelConfig`` and the layout fields from the target ``Layout``. Values stay
within what ``torch.load(weights_only=True)`` reads once megatron-core has registered its safe globals
(``megatron/core/safe_globals.py``): plain Python values and containers, ``torch.dtype``,
``argparse.Namespace``, ``pathlib.PosixPath`` and the megatron-core enums it lists.
"""
from __future__ import annotations

import argparse
import copy
import math
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .config import ModelConfig, linear_attention_freq
from .errors import ConvertError
from .layout.topology import Layout

CFG, LAYOUT, DERIVED = "cfg", "layout", "derived"  # where complete_args takes a value from ("": the default)


@dataclass(frozen=True)
class Arg:
    name: str
    default: Any  # Megatron-LM 0.19's default (for CFG/LAYOUT/DERIVED rows: when nothing gives a value)
    readers: str  # letters of the loaders that read it (module docstring)
    source: str = ""  # "": keep the source's value, else fill the default; CFG / LAYOUT / DERIVED: computed


ARGS: tuple[Arg, ...] = (
    # model shape: from the ModelConfig
    Arg("num_layers", None, "LCRB", CFG),
    Arg("hidden_size", None, "LCB", CFG),
    Arg("ffn_hidden_size", None, "LB", CFG),
    Arg("num_attention_heads", None, "LCB", CFG),
    Arg("group_query_attention", False, "LB", CFG),
    Arg("num_query_groups", 1, "LB", CFG),
    Arg("kv_channels", None, "LB", CFG),
    Arg("swiglu", False, "LB", CFG),
    Arg("normalization", "LayerNorm", "LB", CFG),
    Arg("add_bias_linear", True, "LB", CFG),
    Arg("add_qkv_bias", False, "LB", CFG),
    Arg("qk_layernorm", False, "B", CFG),
    Arg("untie_embeddings_and_output_weights", False, "LB", CFG),
    Arg("vocab_size", None, "B", CFG),
    Arg("padded_vocab_size", None, "LCB", CFG),
    Arg("make_vocab_size_divisible_by", 128, "CB", CFG),
    Arg("position_embedding_type", "learned_absolute", "LB", CFG),
    Arg("use_rotary_position_embeddings", False, "L", CFG),
    Arg("max_position_embeddings", None, "LCB", CFG),
    Arg("transformer_impl", "transformer_engine", "B", CFG),
    Arg("num_experts", None, "LB", CFG),
    Arg("moe_ffn_hidden_size", None, "LB", CFG),
    Arg("moe_layer_freq", 1, "LB", CFG),
    Arg("moe_shared_expert_intermediate_size", None, "LB", CFG),
    Arg("moe_shared_expert_gate", False, "B", CFG),
    Arg("moe_router_enable_expert_bias", False, "LB", CFG),
    Arg("multi_latent_attention", False, "LB", CFG),
    Arg("q_lora_rank", None, "LB", CFG),
    Arg("kv_lora_rank", 32, "LB", CFG),
    Arg("qk_head_dim", 128, "LB", CFG),
    Arg("qk_pos_emb_head_dim", 64, "LB", CFG),
    Arg("v_head_dim", 128, "LB", CFG),
    Arg("mtp_num_layers", None, "LB", CFG),
    # precision: --dtype, else the source's, kept consistent with each other
    Arg("params_dtype", torch.float32, "B", DERIVED),
    Arg("bf16", False, "B", DERIVED),
    Arg("fp16", False, "B", DERIVED),
    # norms: Megatron-LM 0.19 names them after TransformerConfig, earlier releases did not
    Arg("layernorm_epsilon", 1e-5, "B", DERIVED),
    Arg("norm_epsilon", 1e-5, "B", DERIVED),
    Arg("layernorm_zero_centered_gamma", False, "B", DERIVED),
    Arg("apply_layernorm_1p", False, "LB", DERIVED),
    Arg("seq_length", None, "L", DERIVED),
    # layout: from the target Layout
    Arg("tensor_model_parallel_size", 1, "LCRB", LAYOUT),
    Arg("pipeline_model_parallel_size", 1, "LCRB", LAYOUT),
    Arg("virtual_pipeline_model_parallel_size", None, "LB", LAYOUT),
    Arg("num_layers_per_virtual_pipeline_stage", None, "L", LAYOUT),
    Arg("num_virtual_stages_per_pipeline_rank", None, "", LAYOUT),
    Arg("decoder_first_pipeline_num_layers", None, "B", LAYOUT),
    Arg("decoder_last_pipeline_num_layers", None, "B", LAYOUT),
    Arg("pipeline_model_parallel_layout", None, "B", LAYOUT),
    Arg("expert_model_parallel_size", 1, "LB", LAYOUT),
    Arg("expert_tensor_parallel_size", None, "B", LAYOUT),
    Arg("sequence_parallel", False, "B", LAYOUT),
    Arg("overlap_p2p_comm", False, "B", LAYOUT),
    Arg("world_size", 1, "R", LAYOUT),
    Arg("data_parallel_size", 1, "R", LAYOUT),
    Arg("ckpt_format", "torch_dist", "L", LAYOUT),
    Arg("no_save_optim", None, "R", LAYOUT),
    Arg("no_save_rng", None, "R", LAYOUT),
    # the rest: the source's value, else Megatron-LM's default
    Arg("add_position_embedding", True, "LC"),
    Arg("rotary_base", 10000, "LB"),
    Arg("rotary_percent", 1.0, "LB"),
    Arg("rotary_interleaved", False, "LB"),
    Arg("rotary_seq_len_interpolation_factor", None, "B"),
    Arg("use_rope_scaling", False, "B"),
    Arg("rope_scaling_factor", 8.0, "B"),
    Arg("squared_relu", False, "LB"),
    Arg("apply_query_key_layer_scaling", False, "LB"),
    Arg("attention_dropout", 0.1, "LB"),
    Arg("hidden_dropout", 0.1, "LB"),
    Arg("init_method_std", 0.02, "B"),
    Arg("init_method_xavier_uniform", False, "B"),
    Arg("qk_l2_norm", False, "B"),
    Arg("heterogeneous_layers_config_path", None, "LB"),
    Arg("heterogeneous_layers_config_encoded_json", None, "L"),
    Arg("experimental_attention_variant", None, "B"),
    Arg("is_hybrid_model", False, "B"),
    Arg("hybrid_layer_pattern", None, "LR"),
    Arg("hybrid_override_pattern", None, "LRB"),
    Arg("spec", None, "L"),
    Arg("mtp_hybrid_override_pattern", None, "L"),
    Arg("mtp_use_repeated_layer", False, "L"),
    Arg("mamba_state_dim", 128, "L"),
    Arg("mamba_head_dim", 64, "L"),
    Arg("mamba_num_groups", 8, "L"),
    Arg("mamba_num_heads", None, "L"),
    Arg("moe_router_topk", 2, "LB"),
    Arg("moe_router_pre_softmax", False, "LB"),
    Arg("moe_router_score_function", "softmax", "LB"),
    Arg("moe_router_topk_scaling_factor", None, "LB"),
    Arg("moe_router_num_groups", None, "LB"),
    Arg("moe_router_group_topk", None, "LB"),
    Arg("moe_router_dtype", None, "LB"),
    Arg("moe_router_load_balancing_type", "aux_loss", "LB"),
    Arg("rope_type", None, "LB"),
    Arg("rotary_scaling_factor", 1.0, "LB"),
    Arg("mscale", 1.0, "LB"),
    Arg("mscale_all_dim", 0.0, "LB"),
    Arg("moe_token_dispatcher_type", "allgather", "LB"),
    Arg("moe_grouped_gemm", False, "LB"),
    Arg("moe_single_grouped_weight", False, "L"),
    Arg("moe_single_grouped_bias", False, "L"),
    Arg("moe_latent_size", None, "L"),
    Arg("no_persist_layer_norm", False, "B"),
    Arg("bias_swiglu_fusion", True, "B"),
    Arg("bias_gelu_fusion", True, "B"),
    Arg("fp8_param_gather", False, "B"),
    Arg("fp16_lm_cross_entropy", False, "B"),
    Arg("init_model_with_meta_device", False, "B"),
    Arg("config_logger_dir", "", "B"),
    Arg("cp_comm_type", ["p2p"], "B"),
    Arg("context_parallel_size", 1, "B"),
    Arg("tokenizer_type", None, "LCB"),
    Arg("tokenizer_model", None, "LB"),
    Arg("tiktoken_pattern", None, "LB"),
    Arg("vocab_file", None, "B"),
    Arg("merge_file", None, "B"),
    Arg("data_parallel_random_init", False, "C"),
    Arg("global_batch_size", None, "CR"),
    Arg("ckpt_fully_parallel_save", True, "R"),
    Arg("consumed_train_samples", 0, "R"),
    Arg("skipped_train_samples", 0, "R"),
    Arg("consumed_valid_samples", 0, "R"),
)
BY_NAME: dict[str, Arg] = {a.name: a for a in ARGS}

# megatron-core 0.19.2's SAFE_GLOBALS (megatron/core/safe_globals.py), by module and name, plus what
# torch's weights_only unpickler reads by itself: what a target's args may hold.
SAFE_CLASSES = frozenset({
    "argparse.Namespace", "types.SimpleNamespace", "pathlib.PosixPath", "_io.BytesIO", "signal.Signals",
    "megatron.core.enums.ModelType", "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.CudaGraphModule", "megatron.core.transformer.enums.CudaGraphScope",
    "megatron.core.transformer.enums.InferenceCudaGraphScope",
    "megatron.core.optimizer.optimizer_config.OptimizerConfig",
    "megatron.core.rerun_state_machine.RerunDiagnostic", "megatron.core.rerun_state_machine.RerunMode",
    "megatron.core.rerun_state_machine.RerunState",
})
_PLAIN = (type(None), bool, int, float, str, bytes, torch.dtype, torch.Size)
# What dist_convert before the Origin record (datamodel.Origin) put into args as a side channel between formats:
# read back from old checkpoints (formats.base.read_origin), dropped from every target's args
LEGACY_ORIGIN_ARGS = ("hf_config", "nemo_config", "nemo_source", "nemo2_source", "bridge_source", "hf_model_id",
                      "bridge_layer_spec")
HF_TOKENIZER = "HuggingFaceTokenizer"


def complete_args(args: argparse.Namespace, cfg: ModelConfig, layout: Layout, dtype: torch.dtype | None = None,
                  ckpt_format: str | None = None, optimizer_saved: bool = False,
                  rng_saved: bool = False) -> argparse.Namespace:
    """Target args: a copy of the source's ``args``, missing fields filled, model and layout fields set.

    ``ckpt_format``: Megatron-LM's name of the target format ("torch_dist", "torch"; None keeps the
    source's). ``optimizer_saved`` / ``rng_saved``: whether the target holds that state (Megatron-LM
    skips loading what ``no_save_optim`` / ``no_save_rng`` say is absent)."""
    out = copy.copy(args)
    for name in LEGACY_ORIGIN_ARGS:
        if hasattr(out, name):
            delattr(out, name)
    for a in ARGS:
        if a.source == "" and not hasattr(out, a.name):
            setattr(out, a.name, copy.deepcopy(a.default))
    for name, value in {**_model_fields(out, cfg, layout), **_precision_fields(out, dtype), **_norm_fields(out),
                        **_layout_fields(out, cfg, layout, ckpt_format, optimizer_saved, rng_saved)}.items():
        setattr(out, name, value)
    check_loadable(out)
    return out


def args_for_target(args: argparse.Namespace, cfg: ModelConfig, layout: Layout, dtype: torch.dtype | None,
                    ckpt_format: str | None = None, optimizer_saved: bool = False,
                    tokenizer: Path | None = None) -> argparse.Namespace:
    """The source args completed for the target (``complete_args``): every field Megatron-LM's and
    Megatron-Bridge's loaders read, the model fields from ``cfg`` and the layout fields from ``layout``.
    ``tokenizer``: the directory of the source's HF tokenizer (its Origin's), written as Megatron-LM's own
    ``tokenizer_model`` (which it loads with ``--use-tokenizer-model-from-checkpoint-args``) where the args
    name a HuggingFaceTokenizer and no location of it."""
    out = complete_args(args, cfg, layout, dtype, ckpt_format, optimizer_saved=optimizer_saved)
    if tokenizer is not None and out.tokenizer_type == HF_TOKENIZER and out.tokenizer_model is None:
        out.tokenizer_model = str(tokenizer)
    return out


def _model_fields(args: argparse.Namespace, cfg: ModelConfig, layout: Layout) -> dict[str, Any]:
    heads, groups = cfg.num_attention_heads, cfg.num_query_groups
    f: dict[str, Any] = {
        "hidden_size": cfg.hidden_size, "ffn_hidden_size": cfg.ffn_hidden_size, "num_attention_heads": heads,
        "group_query_attention": groups != heads, "num_query_groups": groups, "kv_channels": cfg.kv_channels,
        # Megatron-LM's --swiglu and --quick-geglu are exclusive ways of saying "gated"
        "swiglu": cfg.swiglu and cfg.activation != "quick_gelu", "normalization": cfg.normalization,
        "add_bias_linear": cfg.add_bias_linear,
        "add_qkv_bias": cfg.add_qkv_bias, "qk_layernorm": cfg.qk_layernorm,
        "untie_embeddings_and_output_weights": cfg.untie_embeddings_and_output_weights,
        "vocab_size": cfg.vocab_size, "make_vocab_size_divisible_by": cfg.make_vocab_size_divisible_by,
        "padded_vocab_size": cfg.padded_vocab(layout.tp), "position_embedding_type": cfg.position_embedding_type,
        "use_rotary_position_embeddings": cfg.position_embedding_type == "rope",
        "max_position_embeddings": cfg.max_position_embeddings if cfg.max_position_embeddings is not None
        else getattr(args, "max_position_embeddings", None),
        "transformer_impl": "local" if cfg.spec == "local" else "transformer_engine",
    }
    f.update(multi_latent_attention=cfg.mla, mtp_num_layers=cfg.mtp_num_layers or None)
    # dist_convert's own fields for what Megatron-LM's args cannot say (Megatron-Bridge's Gemma 3 has them),
    # written only where they are set, so a Llama's args stay Megatron-LM's
    # (and megatron-core's own quick_geglu / softmax_type the same way)
    for name, value, unset in (("glu_activation", cfg.activation if cfg.swiglu else "silu", "silu"),
                               ("squared_relu", cfg.activation == "squared_relu" and not cfg.swiglu, False),
                               ("attention_output_gate", cfg.attention_output_gate, False),
                               ("post_norms", cfg.post_norms, False),
                               ("quick_geglu", cfg.swiglu and cfg.activation == "quick_gelu", False),
                               ("softmax_type", cfg.softmax_type, "vanilla")):
        if value != unset or hasattr(args, name):
            f[name] = value
    if cfg.mla:
        f.update(q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_head_dim=cfg.qk_head_dim,
                 qk_pos_emb_head_dim=cfg.qk_pos_emb_head_dim, v_head_dim=cfg.v_head_dim)
    else:
        for name in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            if not hasattr(args, name):
                f[name] = copy.deepcopy(BY_NAME[name].default)
    if cfg.family == "t5":  # Megatron-LM's T5 keeps its own num_layers; the stacks have their own fields
        f.update(encoder_num_layers=cfg.encoder_num_layers, decoder_num_layers=cfg.num_layers)
        f["num_layers"] = getattr(args, "num_layers", None) or cfg.num_layers
    else:
        f["num_layers"] = cfg.num_layers
    if not getattr(args, "seq_length", None):
        f["seq_length"] = f["max_position_embeddings"]
    if cfg.num_experts:
        f.update(num_experts=cfg.num_experts, moe_ffn_hidden_size=cfg.expert_ffn,
                 moe_layer_freq=1 if cfg.moe_layer_pattern is None else list(cfg.moe_layer_pattern),
                 moe_shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size,
                 moe_shared_expert_gate=cfg.moe_shared_expert_gate,
                 moe_router_enable_expert_bias=cfg.moe_router_expert_bias)
    else:  # Megatron-LM: no num_experts means a dense model, and no expert FFN size
        f.update(num_experts=None, moe_ffn_hidden_size=None)
        for name in ("moe_layer_freq", "moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
                     "moe_router_enable_expert_bias"):
            if not hasattr(args, name):
                f[name] = copy.deepcopy(BY_NAME[name].default)
    f.update(_hybrid_fields(args, cfg))
    return f


def _hybrid_fields(args: argparse.Namespace, cfg: ModelConfig) -> dict[str, Any]:
    """MambaModel's pattern and Mamba2 sizes; a Gated DeltaNet model's variant, layer frequency and sizes."""
    f: dict[str, Any] = {}
    if cfg.hybrid_pattern is not None:
        f.update(is_hybrid_model=True, hybrid_override_pattern=cfg.hybrid_pattern, mamba_num_heads=cfg.mamba_num_heads,
                 mamba_head_dim=cfg.mamba_head_dim, mamba_num_groups=cfg.mamba_num_groups,
                 mamba_state_dim=cfg.mamba_state_dim)
        if getattr(args, "hybrid_layer_pattern", None):  # megatron-core 0.19's name, where the source used it
            f["hybrid_layer_pattern"] = cfg.hybrid_pattern
    pattern = cfg.linear_attention_pattern
    if pattern is not None:
        f.update(experimental_attention_variant="gated_delta_net", linear_attention_freq=linear_attention_freq(pattern),
                 linear_num_key_heads=cfg.linear_num_key_heads, linear_num_value_heads=cfg.linear_num_value_heads,
                 linear_key_head_dim=cfg.linear_key_head_dim, linear_value_head_dim=cfg.linear_value_head_dim,
                 linear_conv_kernel_dim=cfg.linear_conv_kernel_dim)
    return f


def _precision_fields(args: argparse.Namespace, dtype: torch.dtype | None) -> dict[str, Any]:
    """``params_dtype``, ``bf16`` and ``fp16`` agreeing with each other: the cast's, else the source's."""
    if dtype is None:
        dtype = getattr(args, "params_dtype", None)
    if not isinstance(dtype, torch.dtype):
        dtype = (torch.bfloat16 if getattr(args, "bf16", False) else
                 torch.float16 if getattr(args, "fp16", False) else torch.float32)
    return {"params_dtype": dtype, "bf16": dtype == torch.bfloat16, "fp16": dtype == torch.float16}


def _norm_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The norm epsilon and zero-centred gamma under both names (Megatron-LM 0.19 and earlier)."""
    eps = next((v for v in (getattr(args, "layernorm_epsilon", None), getattr(args, "norm_epsilon", None))
                if v is not None), BY_NAME["layernorm_epsilon"].default)
    p1 = next((v for v in (getattr(args, "layernorm_zero_centered_gamma", None),
                           getattr(args, "apply_layernorm_1p", None)) if v is not None), False)
    return {"layernorm_epsilon": float(eps), "norm_epsilon": float(eps),
            "layernorm_zero_centered_gamma": bool(p1), "apply_layernorm_1p": bool(p1)}


def _layout_fields(args: argparse.Namespace, cfg: ModelConfig, layout: Layout, ckpt_format: str | None,
                   optimizer_saved: bool, rng_saved: bool) -> dict[str, Any]:
    cp = int(getattr(args, "context_parallel_size", None) or 1)
    uneven = layout.first is not None or layout.last is not None
    text = layout.pipeline_layout  # a layout string places every stage: no other stage field with it
    vpp_layers = cfg.num_layers // (layout.pp * layout.vpp) if layout.vpp and not uneven and text is None else None
    # the smallest world that holds the target: Megatron-LM's TP x PP x CP x DP, and ETP x EP x PP x EDP
    world = layout.pp * math.lcm(layout.tp * cp, layout.expert_tp * layout.ep)
    f: dict[str, Any] = {
        "tensor_model_parallel_size": layout.tp, "pipeline_model_parallel_size": layout.pp,
        "virtual_pipeline_model_parallel_size": layout.vpp,
        # Megatron-LM derives VPP from one of these (uneven stages need the second one)
        "num_layers_per_virtual_pipeline_stage": vpp_layers,
        "num_virtual_stages_per_pipeline_rank": layout.vpp if layout.vpp and uneven and text is None else None,
        "decoder_first_pipeline_num_layers": layout.first, "decoder_last_pipeline_num_layers": layout.last,
        "pipeline_model_parallel_layout": text,
        "expert_model_parallel_size": layout.ep, "expert_tensor_parallel_size": layout.expert_tp,
        "sequence_parallel": bool(getattr(args, "sequence_parallel", False)) and layout.tp > 1,
        "overlap_p2p_comm": bool(getattr(args, "overlap_p2p_comm", True)) if layout.vpp else False,
        "world_size": world, "data_parallel_size": world // (layout.tp * layout.pp * cp),
        "no_save_optim": None if optimizer_saved else True, "no_save_rng": None if rng_saved else True,
    }
    if cfg.family == "t5":
        f["pipeline_model_parallel_split_rank"] = layout.split
    if ckpt_format is not None:
        f["ckpt_format"] = ckpt_format
    elif not hasattr(args, "ckpt_format"):
        f["ckpt_format"] = BY_NAME["ckpt_format"].default
    return f


def check_loadable(args: argparse.Namespace) -> None:
    """Refuse args holding a value that ``torch.load(weights_only=True)`` with megatron-core's safe
    globals cannot read back (Megatron-LM and Megatron-Bridge load args that way)."""
    bad = sorted(f"{name} ({_class_name(v)})" for name, value in vars(args).items()
                 for v in [_unsafe(value)] if v is not None)
    if bad:
        raise ConvertError(f"the checkpoint args hold values Megatron-LM cannot load with weights_only: "
                           f"{', '.join(bad[:8])}{' ...' if len(bad) > 8 else ''}",
                           "remove those fields from the source's args (or convert them to plain values) first")


def _class_name(value: Any) -> str:
    t = value if isinstance(value, type) else type(value)
    return f"{t.__module__}.{t.__qualname__}"


def _unsafe(value: Any) -> Any:
    """The first value inside ``value`` outside the safe set, or None."""
    if isinstance(value, _PLAIN):
        return None
    if isinstance(value, (list, tuple, set)):
        return next((u for u in map(_unsafe, value) if u is not None), None)
    if isinstance(value, dict):
        return next((u for k, v in value.items() for u in (_unsafe(k), _unsafe(v)) if u is not None), None)
    if isinstance(value, (argparse.Namespace, types.SimpleNamespace)):
        return next((u for u in map(_unsafe, vars(value).values()) if u is not None), None)
    return None if _class_name(value) in SAFE_CLASSES else value
