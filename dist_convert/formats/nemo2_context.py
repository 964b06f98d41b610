"""A NeMo 2 ``context/`` for a target whose source is not NeMo 2: NeMo's ``io.json`` is a Fiddle graph of
``TrainerContext(model=GPTModel(config=GPTConfig(...), tokenizer=AutoTokenizer("nemo_tokenizer")),
trainer=Trainer(strategy=MegatronStrategy(...)), extra={})``, which NeMo's ``load_context`` builds; written
here object by object in Fiddle's JSON serialisation (no NeMo import), with ``model.yaml`` (the same config
for readers) and the tokenizer files in ``context/nemo_tokenizer/`` (where NeMo's HF import puts them).
Dense GPT models only (NeMo's GPTConfig; a Llama-3.1 RoPE scaling needs NeMo's Llama31Config: refused).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from ..datamodel import Target
from ..durable import write_durable
from ..features.expressed import refuse_unexpressed
from .base import copy_tokenizer_files
from .mcore_config import PROVIDER_EXPRESSES, fields_for_target, transformer_fields

TOKENIZER_DIR = "nemo_tokenizer"
GPT = "nemo.collections.llm.gpt.model.base"
CLASSES = {"context": ("nemo.lightning.io.pl", "TrainerContext"), "model": (GPT, "GPTModel"),
           "config": (GPT, "GPTConfig"), "trainer": ("nemo.lightning.pytorch.trainer", "Trainer"),
           "strategy": ("nemo.lightning.pytorch.strategies.megatron_strategy", "MegatronStrategy"),
           "tokenizer": ("nemo.collections.common.tokenizers.huggingface.auto_tokenizer", "AutoTokenizer")}
# GPTConfig arguments written (the layout ones come from fields_for_target)
CONFIG_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                 "kv_channels", "gated_linear_unit", "activation_func", "normalization", "layernorm_epsilon",
                 "add_bias_linear", "add_qkv_bias", "qk_layernorm", "share_embeddings_and_output_weights",
                 "position_embedding_type", "rotary_base", "rotary_percent", "seq_length",
                 "make_vocab_size_divisible_by", "hidden_dropout", "attention_dropout", "params_dtype", "bf16", "fp16",
                 "tensor_model_parallel_size", "pipeline_model_parallel_size", "num_layers_in_first_pipeline_stage",
                 "num_layers_in_last_pipeline_stage", "virtual_pipeline_model_parallel_size", "pipeline_dtype",
                 "vocab_size")
_PYREF_TYPE = {"type": "pyref", "module": "fiddle._src.config", "name": "Config"}
_META_TYPE = {"type": "pyref", "module": "fiddle._src.config", "name": "BuildableTraverserMetadata"}


def _pyref(dotted: str) -> dict[str, str]:
    module, name = dotted.rsplit(".", 1)
    return {"type": "pyref", "module": module, "name": name}


class _Graph:
    """Fiddle's JSON serialisation, built object by object (every object referenced once)."""

    def __init__(self) -> None:
        self.objects: dict[str, Any] = {}
        self.counts: dict[str, int] = {}

    def _key(self, base: str) -> str:
        self.counts[base] = self.counts.get(base, 0) + 1
        return f"{base}_{self.counts[base]}"

    def _empty(self, kind: str, extra: dict[str, Any] | None = None) -> dict[str, str]:
        tuple_ty = {"type": "pyref", "module": "builtins", "name": "tuple"}
        key = self._key(kind)
        meta = None if kind == "tuple" else {"type": tuple_ty, "items": [], "metadata": None}
        self.objects[key] = {"type": {"type": "pyref", "module": "builtins", "name": kind}, "items": [],
                             "metadata": meta, **(extra or {})}
        return {"type": "ref", "key": key}

    def config(self, name: str, path: str, args: dict[str, Any]) -> dict[str, str]:
        """A ``fdl.Config`` of class ``CLASSES[name]`` with ``args`` (dicts with ``_target_``: references
        to callables or dtypes; {"type": "ref"}: objects made before)."""
        module, cls = CLASSES[name]
        names = self._empty("tuple")
        self.objects[names["key"]]["items"] = [[f"Index(index={i})", k] for i, k in enumerate(args)]
        meta_key = self._key("buildable_traverser_metadata")
        self.objects[meta_key] = {"type": _META_TYPE, "items": [
            ["Attr(name='fn_or_cls')", {"type": "pyref", "module": module, "name": cls}],
            ["Attr(name='argument_names')", names], ["Attr(name='argument_tags')", self._empty("dict")],
            ["Attr(name='argument_history')", self._empty("dict")]], "metadata": _META_TYPE}
        items = []
        for k, v in args.items():
            if isinstance(v, dict) and v.get("type") == "ref":
                node = v
            elif isinstance(v, dict) and "_target_" in v:
                node = _pyref(v["_target_"])
            else:
                node = {"type": "leaf", "value": v, "paths": [f"{path}.{k}"]}
            items.append([f"Attr(name='{k}')", node])
        key = self._key(cls.lower())
        self.objects[key] = {"type": _PYREF_TYPE, "items": items, "metadata": {"type": "ref", "key": meta_key},
                             "paths": [path]}
        return {"type": "ref", "key": key}

    def document(self, root: dict[str, str]) -> dict[str, Any]:
        return {"root": root, "objects": self.objects, "refcounts": dict.fromkeys(self.objects, 1),
                "version": "0.0.1"}


# What NeMo 2's GPTConfig written here expresses: GPTModelProvider's settings, without MoE (NeMo's MoE configs are
# other classes) and Llama-3.1 RoPE scaling (NeMo's Llama31Config holds it)
NEMO2_EXPRESSES = {**PROVIDER_EXPRESSES, "moe": {False}, "position.scaling": {None}}


def gpt_config(target: Target, model_section: dict[str, Any]) -> dict[str, Any]:
    """GPTConfig arguments for the target: the model config's fields with the target layout (refused in one line
    for a setting NeMo's GPTConfig does not hold)."""
    refuse_unexpressed(target.cfg, NEMO2_EXPRESSES, "a NeMo 2 GPTConfig written for a model from another format",
                       "convert from the model's NeMo 2 checkpoint, or write --dst-format bridge or torch_dist")
    fields = fields_for_target(model_section, target.cfg, target.layout, target.dtype)
    written = set(CONFIG_FIELDS) | set(transformer_fields(target.cfg))
    return {k: v for k, v in fields.items() if k in written and v is not None}


def write_fresh_context(dst: Path, target: Target, model_section: dict[str, Any], tokenizer: Path | None) -> None:
    """``dst`` (context/): io.json, model.yaml and the tokenizer files of ``tokenizer`` (an HF directory).
    Without a tokenizer the config pins ``vocab_size`` to the target's padded rows (NeMo takes it as is)."""
    config = gpt_config(target, model_section)
    if tokenizer is None:
        config["vocab_size"] = target.cfg.padded_vocab(target.layout.tp)
    else:
        config.pop("vocab_size", None)  # NeMo pads the tokenizer's vocabulary by make_vocab_size_divisible_by x TP
        copy_tokenizer_files(tokenizer, dst / TOKENIZER_DIR)
    layout = target.layout
    g = _Graph()
    model_args: dict[str, Any] = {"config": g.config("config", "<root>.model.config", config)}
    if tokenizer is not None:
        model_args["tokenizer"] = g.config("tokenizer", "<root>.model.tokenizer",
                                           {"pretrained_model_name": TOKENIZER_DIR})
    model = g.config("model", "<root>.model", model_args)
    strategy_args = {"tensor_model_parallel_size": layout.tp, "pipeline_model_parallel_size": layout.pp}
    if layout.vpp:
        strategy_args["virtual_pipeline_model_parallel_size"] = layout.vpp
    if "pipeline_dtype" in config:
        strategy_args["pipeline_dtype"] = config["pipeline_dtype"]
    strategy = g.config("strategy", "<root>.trainer.strategy", strategy_args)
    trainer = g.config("trainer", "<root>.trainer", {"strategy": strategy})
    extra = g._empty("dict", {"paths": ["<root>.extra"]})
    root = g.config("context", "<root>", {"model": model, "trainer": trainer, "extra": extra})
    dst.mkdir(parents=True, exist_ok=True)
    write_durable(dst / "io.json", json.dumps(g.document(root), indent=2))
    y: dict[str, Any] = {"_target_": ".".join(CLASSES["model"]), "config": {"_target_": ".".join(CLASSES["config"]),
                                                                         **config}}
    if tokenizer is not None:
        y["tokenizer"] = {"_target_": ".".join(CLASSES["tokenizer"]), "pretrained_model_name": TOKENIZER_DIR}
    write_durable(dst / "model.yaml", yaml.safe_dump(y, sort_keys=False))
