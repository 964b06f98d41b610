"""Megatron-Bridge checkpoints: Megatron-LM's layout (``latest_checkpointed_iteration.txt``,
``iter_NNNNNNN/``) holding a megatron-core torch_dist save without args, described by
``iter_NNNNNNN/run_config.yaml`` (Bridge's ConfigContainer; the model provider's TransformerConfig
fields under ``model:``, TP/PP included, the vocabulary unpadded unless ``should_pad_vocab``), with
``train_state.pt`` and the HF tokenizer files in ``tokenizer/``. Keys have no prefix.

A target carries the run_config.yaml of the Bridge checkpoint the model came from (its Origin's, through
any chain of conversions) with the layout fields of the target, or is given a ``model:`` and ``tokenizer:``
section written from the model config.
"""
from __future__ import annotations

import argparse
import copy
import io
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import yaml

from ..config import ModelConfig
from ..datamodel import ORIGIN_KEY, Origin, SourceIndex, Target, TargetFile, WrittenFile
from ..durable import write_durable
from ..errors import ConvertError
from ..features.blocks import MTP_SEPARATOR, Mamba
from ..features.expressed import ANY, refuse_unexpressed
from ..layout.topology import Layout
from ..mlm_args import HF_TOKENIZER, MCORE_HYBRID_SPEC
from ..models import config_from_hf
from ..runtime import Runtime
from .base import HOLDS_ALL, copy_tokenizer_files, on_rank0, read_origin, tokenizer_source
from .mcore_config import args_from_fields, callable_name, fields_for_target, provider_expresses, transformer_fields
from .torch_dist import TorchDistFormat, _looks_like, open_weights

RUN_CONFIG = "run_config.yaml"
TRAIN_STATE = "train_state.pt"
TOKENIZER = "tokenizer"
PROVIDER = "megatron.bridge.models.gpt_provider.GPTModelProvider"
MLA_PROVIDER = "megatron.bridge.models.mla_provider.MLAModelProvider"
# megatron-core's HybridModel (its layer pattern) and the HybridStack spec of Transformer Engine layers its provider
# builds by default, by the name Bridge serialises
HYBRID_PROVIDER = "megatron.bridge.models.hybrid.hybrid_provider.HybridModelProvider"
HYBRID_STACK_SPEC = "megatron.bridge.models.hybrid.hybrid_provider.transformer_engine_hybrid_stack_spec"
SPECS = {"local": "megatron.bridge.models.gpt_provider.local_layer_spec",
         "te": "megatron.bridge.models.gpt_provider.transformer_engine_layer_spec"}
# megatron-core's spec of DeepSeek sparse attention (and Gated DeltaNet) layers, as Megatron-Bridge's GLM-5 sets it
EXPERIMENTAL_SPEC = ("megatron.core.models.gpt.experimental_attention_variant_module_specs."
                     "get_transformer_block_with_experimental_attention_variant_spec")


# Megatron-Bridge's layer specs of full-width q/k norms -> the args that say them: its OLMoE spec (Transformer Engine
# norms over the whole width: the model at TP 1 only) and its MiniMax-M2 spec (split over TP, all-reduced)
FULL_QK_NORM_SPECS = {
    "megatron.bridge.models.olmoe.olmoe_provider.olmoe_layer_spec": {"qk_norm_full_width": True},
    "megatron.bridge.models.minimax_m2.minimax_m2_provider.minimax_m2_layer_spec": {
        "qk_norm_full_width": True, "qk_norm_full_width_split": True},
}


def layer_spec(cfg: ModelConfig) -> dict[str, Any]:
    """The provider's ``transformer_layer_spec`` (a carried one may be a ModuleSpec tree of the source's naming):
    GPTModelProvider's for the target's spec naming; megatron-core's experimental-attention spec for DSA; Bridge's
    OLMoE or MiniMax-M2 spec for full-width q/k norms."""
    if cfg.attention.qk_norm_full:
        split = cfg.attention.qk_norm_split
        return {"_call_": False, "_target_": next(k for k, v in FULL_QK_NORM_SPECS.items()
                                                  if v.get("qk_norm_full_width_split", False) == split)}
    return {"_call_": False, "_target_": EXPERIMENTAL_SPEC if cfg.dsa is not None else SPECS[cfg.spec]}


def provider_of(cfg: ModelConfig) -> str:
    """The provider a ``model:`` section written from the model config names."""
    if cfg.mamba is not None:
        return HYBRID_PROVIDER
    return MLA_PROVIDER if cfg.mla is not None else PROVIDER


def is_hybrid_section(model: dict[str, Any]) -> bool:
    """A ``model:`` section of a HybridModel provider (HybridModelProvider, MambaModelProvider, Nemotron-H's): it
    gives the layer pattern."""
    return bool(model.get("hybrid_layer_pattern") or model.get("hybrid_override_pattern"))


def carried_run_config(target: Target) -> dict[str, Any] | None:
    """The run_config.yaml of the Bridge checkpoint the model came from, where its provider builds the target's
    model class (a GPTModel source's provider builds no HybridModel, nor the reverse): else None, and the target's
    is written from the model config."""
    y = target.origin.bridge_run_config
    if y is None or is_hybrid_section(y["model"]) != (target.cfg.mamba is not None):
        return None
    return y


def mtp_depth_pattern(mamba: Mamba) -> str | None:
    """The one pattern HybridModelProvider repeats for each multi-token-prediction depth (``mtp_hybrid_override_
    pattern``, ``mtp_num_layers`` times; None without depths); depths of different patterns are refused."""
    if not mamba.mtp_pattern:
        return None
    depths = set(mamba.mtp_pattern.split(MTP_SEPARATOR))
    if len(depths) > 1:
        raise ConvertError(f"hybrid layer pattern {mamba.full_pattern}: multi-token-prediction depths of different "
                           "patterns, and Megatron-Bridge 0.6.2's HybridModelProvider repeats one depth's pattern",
                           "write --dst-format torch_dist (megatron-core's unified pattern holds them)")
    return depths.pop()


def hybrid_fields(cfg: ModelConfig, layout: Layout) -> dict[str, Any]:
    """HybridModelProvider's pattern and Mamba2 sizes at ``layout``: the pipeline stages marked by '|' where only they
    say them (``Mamba.piped``), no other stage field beside them; the multi-token-prediction depths as one depth's
    pattern and their count, which the provider joins to the main pattern after '/' (``mtp_depth_pattern``)."""
    mamba = cfg.mamba
    piped = mamba.layout_args(cfg, layout)
    main = piped.get("hybrid_override_pattern", mamba.full_pattern).split(MTP_SEPARATOR)[0]
    out = {"hybrid_layer_pattern": main, "hybrid_override_pattern": None,
           "mtp_hybrid_override_pattern": mtp_depth_pattern(mamba), "mtp_num_layers": cfg.mtp_num_layers or None,
           "mamba_num_heads": mamba.num_heads, "mamba_head_dim": mamba.head_dim,
           "mamba_num_groups": mamba.num_groups, "mamba_state_dim": mamba.state_dim}
    if piped:
        out.update(num_layers_in_first_pipeline_stage=None, num_layers_in_last_pipeline_stage=None,
                   pipeline_model_parallel_layout=None)
    return out


def check_bridge_spec(cfg: ModelConfig, tp: int) -> None:
    """Refuse a target Megatron-Bridge's layer spec for the model does not build: its full-width q/k norm specs are
    Transformer Engine's, and its OLMoE one normalises each TP rank's heads alone."""
    a = cfg.attention
    if a.qk_norm_full and cfg.spec == "local":
        raise ConvertError("--target-spec local: Megatron-Bridge builds full-width q/k norms (OLMoE, MiniMax-M2) with "
                           "Transformer Engine's spec only", "drop --target-spec local")
    if a.qk_norm_full and not a.qk_norm_split and tp > 1:
        raise ConvertError(f"a Megatron-Bridge target at TP={tp} of a model with full-width q/k norms in Bridge's "
                           "OLMoE spec, which normalises each TP rank's heads alone (it computes the model at TP 1 "
                           "only)", "pass --target-tp 1 (and --target-ep for more ranks), or write --dst-format "
                           "torch_dist")


def _looks_like_bridge(path: Path) -> bool:
    """A Bridge iteration: a torch_dist save with run_config.yaml, or with Bridge's train_state.pt (and
    run_config.yaml lost: ``index`` says so)."""
    return ((path / RUN_CONFIG).is_file() or (path / TRAIN_STATE).is_file()) and _looks_like(path)


def read_run_config(iter_dir: Path) -> dict[str, Any]:
    path = iter_dir / RUN_CONFIG
    if not path.is_file():
        raise ConvertError(f"{iter_dir} is a Megatron-Bridge iteration without {RUN_CONFIG} (the model config)",
                           f"re-copy {RUN_CONFIG} from the run that saved it, or convert from the HF model with "
                           "--src-format hf")
    try:
        y = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConvertError(f"{path} is not valid YAML ({str(e).splitlines()[0]})", f"restore {RUN_CONFIG}") from None
    if not isinstance(y.get("model"), dict):
        raise ConvertError(f"{path} has no model: section", f"restore {RUN_CONFIG} as Megatron-Bridge saved it")
    return y


# Bridge's vision-language providers whose model: section carries the HF text and vision configs it was built from
VL_PROVIDERS = {"Qwen3VLModelProvider": "Qwen3VLForConditionalGeneration",
                "Qwen3VLMoEModelProvider": "Qwen3VLMoeForConditionalGeneration"}
UNREAD_VL_PROVIDERS = ("Qwen25VLModelProvider", "Gemma3VLModelProvider", "Qwen35VLModelProvider",
                       "Qwen35VLMoEModelProvider", "GLM45VModelProvider")
# Bridge's providers that record the whole HF config (``hf_config``) beside their own fields, and the fields that must
# say what it says: Ministral 3's YaRN, which its provider does not take from the HF config (model field -> key of
# the text config's rope_parameters)
HF_CONFIG_PROVIDERS = {"Ministral3ModelProvider": {
    "rotary_base": "rope_theta", "yarn_rotary_scaling_factor": "factor",
    "yarn_original_max_position_embeddings": "original_max_position_embeddings", "yarn_beta_fast": "beta_fast",
    "yarn_beta_slow": "beta_slow", "yarn_mscale": "mscale", "yarn_mscale_all_dim": "mscale_all_dim"}}
VL_TOKENS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def vl_config(model: dict[str, Any]) -> dict[str, Any] | None:
    """The HF config.json a vision-language provider's ``model:`` section describes (its serialized
    ``hf_text_config`` and ``vision_config``, the token ids and the tie flag), None for a language-model provider."""
    provider = str(model.get("_target_", "")).rsplit(".", 1)[-1]
    if provider in UNREAD_VL_PROVIDERS:
        raise ConvertError(f"a Megatron-Bridge {provider} checkpoint: its {RUN_CONFIG} does not record the HF text "
                           "config the model was built from", "convert from the model's HF release (--src-format hf)")
    if provider in HF_CONFIG_PROVIDERS:
        return recorded_hf_config(model, provider)
    arch = VL_PROVIDERS.get(provider)
    if arch is None:
        return None

    def plain(d: Any, what: str) -> dict[str, Any]:
        if not isinstance(d, dict):
            raise ConvertError(f"{RUN_CONFIG} model: {what} is missing", f"restore {RUN_CONFIG} as Megatron-Bridge "
                               "saved it, or convert from the HF model with --src-format hf")
        return {k: v for k, v in d.items() if k != "_target_" and not (isinstance(v, dict) and "_target_" in v)}

    return {"architectures": [arch], "text_config": plain(model.get("hf_text_config"), "hf_text_config"),
            "vision_config": plain(model.get("vision_config"), "vision_config"),
            "tie_word_embeddings": bool(model.get("share_embeddings_and_output_weights", False)),
            **{k: model[k] for k in VL_TOKENS if model.get(k) is not None}}


def recorded_hf_config(model: dict[str, Any], provider: str) -> dict[str, Any]:
    """The HF config.json a provider's ``hf_config`` records, refused where the provider's own fields (what Bridge's
    model computes) say otherwise."""
    def plain(d: Any) -> Any:
        return {k: plain(v) for k, v in d.items() if k != "_target_"} if isinstance(d, dict) else d

    hf = plain(model.get("hf_config"))
    if not isinstance(hf, dict) or not isinstance(hf.get("text_config"), dict):
        raise ConvertError(f"{RUN_CONFIG} model: {provider} without its hf_config", f"restore {RUN_CONFIG} as "
                           "Megatron-Bridge saved it, or convert from the HF model with --src-format hf")
    rope = hf["text_config"].get("rope_parameters") or {}
    wrong = [f"{field}={model[field]} (hf_config: {rope[key]})" for field, key in HF_CONFIG_PROVIDERS[provider].items()
             if model.get(field) is not None and rope.get(key) is not None
             and float(model[field]) != float(rope[key])]
    if wrong:
        raise ConvertError(f"{RUN_CONFIG} model: {provider}'s {', '.join(wrong)}: Megatron-Bridge's model computes its "
                           "own fields, the recorded HF config another model", "convert from the model's HF release "
                           "(--src-format hf), or correct run_config.yaml to the model that was trained")
    return hf


def bridge_args(iter_dir: Path, y: dict[str, Any]) -> argparse.Namespace:
    model = y["model"]
    args = args_from_fields(model, f"{iter_dir / RUN_CONFIG} model:", f"restore {RUN_CONFIG} as Megatron-Bridge "
                            "saved it")
    hf = vl_config(model)
    if hf is not None:  # the model as its HF family reads it: the language model's settings and the vision record
        vars(args).update(config_from_hf(hf, None)[0].to_args())
    spec = model.get("transformer_layer_spec")
    vars(args).update(FULL_QK_NORM_SPECS.get(spec.get("_target_") if isinstance(spec, dict) else spec, {}))
    if is_hybrid_section(model):  # its HybridStack spec as Megatron-LM's args name one (module, name)
        named = callable_name(model.get("hybrid_stack_spec")) or HYBRID_STACK_SPEC
        args.spec = list(MCORE_HYBRID_SPEC) if named == HYBRID_STACK_SPEC else list(named.rsplit(".", 1))
        if model.get("mtp_hybrid_override_pattern") and model.get("mtp_num_layers"):  # one MTP depth's pattern,
            # mtp_num_layers times (the provider joins them; none without mtp_num_layers)
            args.mtp_hybrid_override_pattern = model["mtp_hybrid_override_pattern"]
    if not model.get("should_pad_vocab", False):  # the embedding holds exactly vocab_size rows
        args.make_vocab_size_divisible_by = 1
    if (iter_dir / TOKENIZER).is_dir():
        args.tokenizer_type = HF_TOKENIZER
    return args


def bridge_origin(iter_dir: Path, y: dict[str, Any], stored: Origin) -> Origin:
    """A Bridge checkpoint's Origin: its run_config.yaml, the HF model it was imported from (``hf_model_id``:
    its generation config) and its tokenizer/, over what a dist_convert Bridge target stored of where the
    model came from before (``stored``: e.g. an HF config.json)."""
    model_id = y["model"].get("hf_model_id")
    tokenizer = iter_dir / TOKENIZER
    return replace(stored, kind=stored.kind or "bridge", bridge_run_config=y,
                   hf_model_id=model_id if isinstance(model_id, str) else stored.hf_model_id,
                   tokenizer=tokenizer.resolve() if tokenizer.is_dir() else stored.tokenizer)


def bridge_model_section(cfg: ModelConfig, args: argparse.Namespace) -> dict[str, Any]:
    """A ``model:`` section for a target whose source is not a Bridge checkpoint: GPTModelProvider's fields (every
    setting of the model; what GPTModelProvider cannot hold is refused before, by the target's format). Experts under
    Bridge's full-width q/k norm specs are grouped, as its OLMoE and MiniMax-M2 providers build them (and its
    weight mappings name them)."""
    grouped = {"moe_grouped_gemm": True} if cfg.attention.qk_norm_full and cfg.moe is not None else {}
    fields, dtype = transformer_fields(cfg), getattr(args, "params_dtype", torch.float32)
    if cfg.mamba is not None:  # HybridModelProvider has no Llama 3 RoPE scaling fields (refused before)
        del fields["rope_scaling"], fields["rope_scaling_factor"]
        fields["hybrid_stack_spec"] = {"_call_": False, "_target_": HYBRID_STACK_SPEC}
        if cfg.gdn is not None:  # the G layers' sizes (the pattern says where they are)
            fields.update({k: v for k, v in cfg.gdn.to_args().items()
                           if k.startswith("linear_") and k != "linear_attention_freq"})
    return {"_target_": provider_of(cfg), **fields, **grouped,
            "seq_length": getattr(args, "seq_length", None) or cfg.max_position_embeddings,
            "should_pad_vocab": cfg.padded_vocab(1) != cfg.vocab_size, "hidden_dropout": 0.0, "attention_dropout": 0.0,
            "params_dtype": {"_call_": False, "_target_": str(dtype)}, "bf16": dtype == torch.bfloat16,
            "fp16": dtype == torch.float16}  # Bridge's providers default to bf16, and its loader casts to it


class BridgeFormat(TorchDistFormat):
    name = "bridge"
    holds = HOLDS_ALL  # a vision-language model's own run_config.yaml carried from a Bridge source (target_files)
    looks_like = staticmethod(_looks_like_bridge)

    def index(self, path: Path, rt: Runtime, vocab_size: int | None) -> SourceIndex:
        return on_rank0(rt, lambda: self._index_bridge(path, vocab_size))

    def _index_bridge(self, path: Path, vocab_size: int | None) -> SourceIndex:
        found = self.find(path)
        if found is None:
            raise ConvertError(f"{path} is not a Megatron-Bridge checkpoint (no iter_*/ with {RUN_CONFIG})",
                               "point SRC at the checkpoint root or an iter_* directory, or pass the right "
                               "--src-format")
        iter_dir, iteration = found
        y = read_run_config(iter_dir)
        md, common, style = open_weights(iter_dir, self.trust_pickle)
        stored, _ = read_origin(self.name, common.get(ORIGIN_KEY), common.get("args") or argparse.Namespace())
        return self.index_weights(iter_dir, iteration, md, common, style, bridge_args(iter_dir, y), vocab_size,
                                  bridge_origin(iter_dir, y, stored))

    def target_files(self, target: Target, dtypes: dict[str, torch.dtype]) -> list[TargetFile]:
        run_config = target.origin.bridge_run_config
        if target.cfg.vision is not None and (run_config is None or vl_config(run_config["model"]) is None):
            raise ConvertError("a Megatron-Bridge target of a vision-language model needs its provider's "
                               f"{RUN_CONFIG}, which only the model's own Bridge checkpoint carries",
                               "convert from that Bridge checkpoint, or write --dst-format torch_dist (the same "
                               "layout, with Megatron-LM args)")
        check_bridge_spec(target.cfg, target.layout.tp)
        if target.cfg.mamba is not None:
            mtp_depth_pattern(target.cfg.mamba)  # refused before anything is written
        if target.cfg.mamba is not None and target.layout.vpp:
            raise ConvertError(f"a Megatron-Bridge target of a HybridModel at VPP={target.layout.vpp}: Megatron-Bridge "
                               "0.6.2's HybridModelProvider builds no virtual pipeline stages", "drop --target-vpp "
                               "(or use a --target-pipeline-layout of one stage per PP rank), or write --dst-format "
                               "torch_dist")
        if carried_run_config(target) is None:  # run_config.yaml written from the model config: refused first
            provider = provider_of(target.cfg).rsplit(".", 1)[1]
            declared = {**provider_expresses(target.cfg), "attention.qk_norm_full": ANY}  # Bridge's own specs
            refuse_unexpressed(target.cfg, declared, f"Megatron-Bridge's {provider} (written "
                               "for a model that does not come from a Bridge checkpoint)", "convert from the model's "
                               "own Megatron-Bridge checkpoint, or write --dst-format torch_dist")
        return super().target_files(target, dtypes)

    def common_state(self, target: Target) -> dict[str, Any]:
        return {**super().common_state(target), "content_metadata": {"singleton_local_shards": False,
                                                                       "chained_optim_avoid_prefix": True}}

    def run_config_sections(self, target: Target, y: dict[str, Any]) -> None:
        """Sections a kind of Bridge checkpoint adds to run_config.yaml (a LoRA adapter's ``peft:``)."""

    def finalize(self, target: Target, iter_dir: Path, written: list[WrittenFile]) -> None:
        """The torch_dist metadata, then run_config.yaml, train_state.pt and tokenizer/."""
        args, cfg = target.args, target.cfg
        carried = carried_run_config(target)
        if carried is not None:  # a Bridge source's, carried (never re-read from its path)
            y = copy.deepcopy(carried)
            model = fields_for_target(y["model"], cfg, target.layout, target.dtype)
        else:
            y, model = {}, fields_for_target(bridge_model_section(cfg, args), cfg, target.layout, target.dtype)
        if cfg.mamba is not None:
            model.update(hybrid_fields(cfg, target.layout))
        else:
            model["transformer_layer_spec"] = layer_spec(cfg)
        if model.get("should_pad_vocab") is False and cfg.padded_vocab(target.layout.tp) != cfg.vocab_size:
            model["should_pad_vocab"] = True
        y["model"] = model
        tok = tokenizer_source(target.origin, self.options.tokenizer_dir)
        if tok is not None:
            copy_tokenizer_files(tok, iter_dir / TOKENIZER)
        if "tokenizer" not in y:  # Bridge's TokenizerConfig names the tokenizer the files came from
            y["tokenizer"] = {"_target_": "megatron.bridge.training.tokenizers.config.TokenizerConfig",
                              "tokenizer_type": "HuggingFaceTokenizer" if tok is not None else "NullTokenizer",
                              "tokenizer_model": str(tok) if tok is not None else None,
                              "vocab_size": None if tok is not None else cfg.vocab_size}
        self.run_config_sections(target, y)
        write_durable(iter_dir / RUN_CONFIG, yaml.safe_dump(y, sort_keys=False))
        buf = io.BytesIO()
        zero = torch.tensor(0)
        torch.save({"step": zero, "consumed_train_samples": zero, "skipped_train_samples": zero,
                    "consumed_valid_samples": zero, "floating_point_operations_so_far": torch.tensor(0.0),
                    "do_train": torch.tensor(False), "do_valid": torch.tensor(False),
                    "do_test": torch.tensor(False)}, buf)
        for where in (iter_dir / TRAIN_STATE, iter_dir.parent / f"latest_{TRAIN_STATE}"):  # Bridge writes both
            write_durable(where, buf.getvalue())
        super().finalize(target, iter_dir, written)
