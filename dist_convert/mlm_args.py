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
import dataclasses
import math
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .config import ALWAYS, RECORDS, ModelConfig
from .errors import ConvertError
from .features.base import DERIVED, MODEL
from .layout.topology import Layout

CFG, LAYOUT = MODEL, "layout"  # where complete_args takes a value from (and DERIVED; "": the default)


@dataclass(frozen=True)
class Arg:
    name: str
    default: Any  # Megatron-LM 0.19's default (for CFG/LAYOUT/DERIVED rows: when nothing gives a value)
    readers: str  # letters of the loaders that read it (module docstring)
    source: str = ""  # "": keep the source's value, else fill the default; CFG / LAYOUT / DERIVED: computed


def setting_rows() -> tuple[Arg, ...]:
    """The rows of the args names the model's settings declare (``features.base.MegatronArg``): the core's and every
    record's."""
    fields = [*dataclasses.fields(ModelConfig), *(f for cls in RECORDS.values() for _, f in cls.leaf_fields())]
    return tuple(Arg(name, known.default, known.readers, known.source) for f in fields
                 for name, known in zip(f.metadata.get("arg", ()), f.metadata.get("mlm", ()), strict=False)
                 if known is not None)


ARGS: tuple[Arg, ...] = (
    # the settings' names (their Megatron-LM defaults and readers are declared on them)
    *setting_rows(),
    # model shape no setting names: from the ModelConfig
    Arg("group_query_attention", False, "LB", CFG),
    Arg("padded_vocab_size", None, "LCB", CFG),
    Arg("use_rotary_position_embeddings", False, "L", CFG),
    Arg("multi_latent_attention", False, "LB", CFG),
    # precision: --dtype, else the source's, kept consistent with each other
    Arg("params_dtype", torch.float32, "B", DERIVED),
    Arg("bf16", False, "B", DERIVED),
    Arg("fp16", False, "B", DERIVED),
    # the source's sequence length, else the context length
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
    Arg("apply_query_key_layer_scaling", False, "LB"),
    Arg("attention_dropout", 0.1, "LB"),
    Arg("hidden_dropout", 0.1, "LB"),
    Arg("init_method_std", 0.02, "B"),
    Arg("init_method_xavier_uniform", False, "B"),
    Arg("heterogeneous_layers_config_path", None, "LB"),
    Arg("heterogeneous_layers_config_encoded_json", None, "L"),
    Arg("experimental_attention_variant", None, "B"),
    Arg("is_hybrid_model", False, "B"),
    Arg("spec", None, "L"),
    Arg("mtp_hybrid_override_pattern", None, "L"),
    Arg("mtp_use_repeated_layer", False, "L"),
    Arg("moe_router_load_balancing_type", "aux_loss", "LB"),
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
# the args of the plain model: each always-present record's defaults (a field at its plain value is not written
# unless Megatron-LM's table lists it or the source has it)
PLAIN_ARGS: dict[str, Any] = {k: v for name in ALWAYS for k, v in RECORDS[name]().to_args().items()}


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
    for name, value in {**_model_fields(out, cfg, layout), **_precision_fields(out, dtype),
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


# megatron-core's hybrid stack, by the name every release in use holds: 0.16's MambaModel spec, and from 0.19 on (main
# too) an alias of models/hybrid's hybrid_stack_spec
MCORE_HYBRID_SPEC = ("megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec")


def layer_spec_arg(cfg: ModelConfig, source: dict[str, Any]) -> Any:
    """The target args' ``spec`` (Megatron-LM's ``--spec``, which ``--use-checkpoint-args`` takes from the checkpoint:
    the layer spec's module and name) for the model ``cfg``, from the source's args ``source``: a HybridModel made
    from a GPTModel names megatron-core's hybrid stack (Megatron-LM's hybrid builder needs one), a GPTModel
    made from a HybridModel none (Megatron-LM's default); otherwise the source's spec stays."""
    spec = source.get("spec")
    was_hybrid = bool(source.get("hybrid_override_pattern") or source.get("hybrid_layer_pattern"))
    if cfg.mamba is None:
        return None if was_hybrid else spec  # a hybrid's spec is a HybridStack's, which no GPTModel builds
    return spec if was_hybrid else list(MCORE_HYBRID_SPEC)


def _model_fields(args: argparse.Namespace, cfg: ModelConfig, layout: Layout) -> dict[str, Any]:
    """The model's fields, as its records write them (``ModelConfig.to_args``). A field Megatron-LM's table does not
    list (dist_convert's own, Megatron-Bridge's, a newer megatron-core's) is written only where it says something:
    its value is not the plain model's, or the source's args have it; so a Llama's args stay Megatron-LM's."""
    f: dict[str, Any] = {name: value for name, value in cfg.to_args().items()
                         if name in BY_NAME or value != PLAIN_ARGS.get(name) or hasattr(args, name)}
    f["padded_vocab_size"] = cfg.padded_vocab(layout.tp)
    f["spec"] = layer_spec_arg(cfg, vars(args))
    f["max_position_embeddings"] = cfg.max_position_embeddings if cfg.max_position_embeddings is not None \
        else getattr(args, "max_position_embeddings", None)
    if cfg.t5 is not None:  # Megatron-LM's T5 keeps its own num_layers; the stacks have their own fields
        f.update(decoder_num_layers=cfg.num_layers)
        f["num_layers"] = getattr(args, "num_layers", None) or cfg.num_layers
    else:
        f["num_layers"] = cfg.num_layers
    if not getattr(args, "seq_length", None):
        f["seq_length"] = f["max_position_embeddings"]
    for a in ARGS:  # the model fields of features the model lacks: Megatron-LM's defaults where the source has none
        if a.source == CFG and a.name not in f and not hasattr(args, a.name):
            f[a.name] = copy.deepcopy(a.default)
    return f


def model_args(cfg: ModelConfig, dtype: torch.dtype, **extra: Any) -> argparse.Namespace:
    """The Megatron-LM args of a model known only by its config (a Hugging Face import): the model's fields,
    Megatron-LM's defaults, the dtype, a TP1 PP1 layout and ``extra``."""
    return complete_args(argparse.Namespace(hidden_dropout=0.0, attention_dropout=0.0, **extra), cfg,
                         Layout(tp=1, pp=1), dtype)


def _precision_fields(args: argparse.Namespace, dtype: torch.dtype | None) -> dict[str, Any]:
    """``params_dtype``, ``bf16`` and ``fp16`` agreeing with each other: the cast's, else the source's."""
    if dtype is None:
        dtype = getattr(args, "params_dtype", None)
    if not isinstance(dtype, torch.dtype):
        dtype = (torch.bfloat16 if getattr(args, "bf16", False) else
                 torch.float16 if getattr(args, "fp16", False) else torch.float32)
    return {"params_dtype": dtype, "bf16": dtype == torch.bfloat16, "fp16": dtype == torch.float16}


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
        "sequence_parallel": (bool(getattr(args, "sequence_parallel", False)) and layout.tp > 1)
        or cfg.needs_sequence_parallel(layout.tp),
        "overlap_p2p_comm": bool(getattr(args, "overlap_p2p_comm", True)) if layout.vpp else False,
        "world_size": world, "data_parallel_size": world // (layout.tp * layout.pp * cp),
        "no_save_optim": None if optimizer_saved else True, "no_save_rng": None if rng_saved else True,
    }
    if cfg.t5 is not None:
        f["pipeline_model_parallel_split_rank"] = layout.split
    for record in cfg.records():
        f.update(record.layout_args(cfg, layout))
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
