"""NeMo 2 checkpoints: ``CKPT/weights/`` is a megatron-core torch_dist save whose keys carry the prefix
``module.`` (NeMo's MegatronParallel wraps the model) and whose common state is Lightning's, without
args; ``CKPT/context/`` holds NeMo's ``io.json`` (a Fiddle graph of the TrainerContext), ``model.yaml``
(NeMo >= 2.1: the model's ``config:`` in megatron-core TransformerConfig names, TP/PP of the run that
saved it included; ``vocab_size`` usually null) and the tokenizer artifacts. The model config comes
from ``model.yaml``, else from the config object of ``io.json`` over the defaults of its class (read
here, without importing NeMo).

A target carries the ``context/`` of the NeMo 2 checkpoint the model came from (its Origin's) with the
parallel fields of the target layout in both ``model.yaml`` and ``io.json`` (the model config's and the
trainer strategy's); from other sources it gets a context of NeMo's GPTModel/GPTConfig written from the
model config (nemo2_context.py).
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import yaml

from ..datamodel import Origin, SourceIndex, Target, TargetFile, WrittenFile
from ..durable import write_durable
from ..errors import ConvertError
from ..mlm_args import HF_TOKENIZER
from ..runtime import Runtime
from .base import HOLDS_LANGUAGE_MODEL, on_rank0, tokenizer_source
from .bridge import bridge_model_section
from .mcore_config import PARALLEL, args_from_fields, fields_for_target
from .nemo2_context import gpt_config, write_fresh_context
from .torch_dist import TorchDistFormat, open_weights

CONTEXT, WEIGHTS = "context", "weights"
MODEL_YAML, IO_JSON = "model.yaml", "io.json"
PREFIX = "module."
EMBEDDING = PREFIX + "embedding.word_embeddings.weight"
# io.json stores only the arguments a config was built with: the layout-defining defaults of NeMo's
# config classes (by class-name prefix, most specific first; megatron-core TransformerConfig's under GPTConfig)
_LLAMA = {"normalization": "RMSNorm", "gated_linear_unit": True, "activation_func": "torch.nn.functional.silu",
          "position_embedding_type": "rope", "add_bias_linear": False, "share_embeddings_and_output_weights": False,
          "seq_length": 4096}
_GPT = {"normalization": "LayerNorm", "gated_linear_unit": False, "activation_func": "torch.nn.functional.gelu",
        "position_embedding_type": "learned_absolute", "add_bias_linear": True, "add_qkv_bias": False,
        "share_embeddings_and_output_weights": True, "seq_length": 1024, "make_vocab_size_divisible_by": 128,
        "layernorm_epsilon": 1e-5, "rotary_base": 10000, "qk_layernorm": False}
CLASS_DEFAULTS: list[tuple[str, dict[str, Any]]] = [
    ("Llama3", {**_GPT, **_LLAMA, "rotary_base": 500_000, "seq_length": 8192}),
    ("Llama", {**_GPT, **_LLAMA}), ("Mistral", {**_GPT, **_LLAMA, "seq_length": 32768}),
    ("Qwen2", {**_GPT, **_LLAMA, "add_qkv_bias": True, "rotary_base": 1_000_000}),
    ("Qwen3", {**_GPT, **_LLAMA, "qk_layernorm": True, "rotary_base": 1_000_000}),
    ("GPTConfig", _GPT),
]
# strategy fields NeMo's MegatronStrategy takes from the layout (and hands to the model config at setup)
STRATEGY = {"tensor_model_parallel_size": "tp", "pipeline_model_parallel_size": "pp",
            "expert_model_parallel_size": "ep", "virtual_pipeline_model_parallel_size": "vpp"}


def _looks_like(path: Path) -> bool:
    return (path / WEIGHTS).is_dir() and (path / CONTEXT).is_dir()


class FiddleGraph:
    """Read access to NeMo's ``io.json``: objects by key, each a Config of (argument -> value) items."""

    def __init__(self, path: Path) -> None:
        try:
            self.doc = json.loads(path.read_text())
            self.objects: dict[str, Any] = self.doc["objects"]
            self.root = self.doc["root"]["key"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ConvertError(f"{path} is not NeMo's io.json ({e})", "restore context/io.json as NeMo saved it") \
                from None

    def items(self, key: str) -> dict[str, Any]:
        """Argument name -> stored value of Config object ``key`` (refs left as {"type": "ref"})."""
        out = {}
        for attr, value in self.objects[key].get("items", []):
            name = attr.removeprefix("Attr(name='").removesuffix("')")
            out[name] = value
        return out

    def child(self, key: str, name: str) -> str | None:
        value = self.items(key).get(name)
        return value["key"] if isinstance(value, dict) and value.get("type") == "ref" else None

    def class_name(self, key: str) -> str:
        meta = self.objects[key].get("metadata", {})
        meta = self.objects.get(meta.get("key", ""), {}) if meta.get("type") == "ref" else {}
        for attr, value in meta.get("items", []):
            if attr == "Attr(name='fn_or_cls')":
                return str(value.get("name"))
        return "?"

    def leaves(self, key: str) -> dict[str, Any]:
        """The plain values among an object's arguments (a function reference as its dotted name)."""
        out = {}
        for name, v in self.items(key).items():
            if isinstance(v, dict) and v.get("type") == "leaf":
                out[name] = v["value"]
            elif isinstance(v, dict) and v.get("type") == "pyref":
                out[name] = f"{v['module']}.{v['name']}"
            elif not isinstance(v, dict):
                out[name] = v
        return out

    def set_leaf(self, key: str, name: str, value: Any, path: str, pyref: str | None = None) -> None:
        """Set (or add) a plain argument of object ``key`` (``pyref``: a reference to the dotted name
        instead, e.g. ``torch.bfloat16``): Fiddle rebuilds a Config by zipping its values with
        ``argument_names`` of its metadata, so an added argument is named there too."""
        items = self.objects[key].setdefault("items", [])
        leaf = {"type": "leaf", "value": value, "paths": [f"{path}.{name}"]} if pyref is None else \
            {"type": "pyref", "module": pyref.rsplit(".", 1)[0], "name": pyref.rsplit(".", 1)[1]}
        for item in items:
            if item[0] == f"Attr(name='{name}')":
                item[1] = leaf
                return
        items.append([f"Attr(name='{name}')", leaf])
        meta = self.objects[self.objects[key]["metadata"]["key"]]
        names = next(v for a, v in meta["items"] if a == "Attr(name='argument_names')")
        entries = self.objects[names["key"]]["items"]
        entries.append([f"Index(index={len(entries)})", name])


def config_fields(context: Path) -> tuple[dict[str, Any], str]:
    """The model config's TransformerConfig fields and where they were read."""
    if (context / MODEL_YAML).is_file():
        try:
            y = yaml.safe_load((context / MODEL_YAML).read_text()) or {}
        except yaml.YAMLError as e:
            raise ConvertError(f"{context / MODEL_YAML} is not valid YAML ({str(e).splitlines()[0]})",
                               "restore context/model.yaml as NeMo saved it") from None
        if not isinstance(y.get("config"), dict):
            raise ConvertError(f"{context / MODEL_YAML} has no config: section (the model's GPTConfig)",
                               "restore context/model.yaml as NeMo saved it, or delete it so that io.json is read")
        return y["config"], f"{context / MODEL_YAML} config:"
    if not (context / IO_JSON).is_file():
        raise ConvertError(f"{context} has neither {MODEL_YAML} nor {IO_JSON}", "re-copy the NeMo 2 context/ directory")
    g = FiddleGraph(context / IO_JSON)
    model = g.child(g.root, "model")
    config = g.child(model, "config") if model else None
    if config is None:
        raise ConvertError(f"{context / IO_JSON} has no model.config object", "re-copy the NeMo 2 context/ directory")
    name = g.class_name(config)
    defaults = next((d for prefix, d in CLASS_DEFAULTS if name.startswith(prefix)), None)
    if defaults is None:
        raise ConvertError(f"{context / IO_JSON} builds the model config {name}, whose defaults dist_convert does "
                           f"not know (io.json stores only the arguments given)",
                           f"add {MODEL_YAML} to context/ (NeMo >= 2.1 writes it: load and re-save the checkpoint "
                           "with NeMo), or convert a checkpoint that has it")
    return {**defaults, **g.leaves(config)}, f"{context / IO_JSON} ({name})"


def tokenizer_dir(context: Path) -> Path | None:
    """The tokenizer artifact directory inside context/ (a directory with tokenizer files), if any."""
    for d in sorted(p for p in context.rglob("*") if p.is_dir()):
        if any((d / n).is_file() for n in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
            return d
    return None


def tokenizer_vocab_size(tok: Path) -> int | None:
    """The vocabulary size of an HF ``tokenizer.json`` (base vocabulary and added tokens), None if unreadable."""
    try:
        doc = json.loads((tok / "tokenizer.json").read_text())
        vocab = doc["model"]["vocab"]
        ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
        ids += [int(t["id"]) for t in doc.get("added_tokens") or []]
        return max(ids) + 1 if ids else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def nemo2_args(ckpt: Path, md: Any) -> argparse.Namespace:
    fields, where = config_fields(ckpt / CONTEXT)
    args = args_from_fields(fields, where, "restore context/ as NeMo saved it")
    emb = md.state_dict_metadata.get(EMBEDDING)
    if emb is not None and getattr(emb, "size", None) is not None:
        args.padded_vocab_size = int(emb.size[0])  # padded by make_vocab_size_divisible_by x TP of the run
    tok = tokenizer_dir(ckpt / CONTEXT)
    if tok is not None:
        args.tokenizer_type = HF_TOKENIZER
        if getattr(args, "vocab_size", None) is None:  # NeMo sizes the embedding from the tokenizer
            args.vocab_size = tokenizer_vocab_size(tok)
    return args


def nemo2_origin(ckpt: Path) -> Origin:
    """A NeMo 2 checkpoint's Origin: its context/ (copied into a nemo2 target) and the tokenizer artifact in it."""
    tok = tokenizer_dir(ckpt / CONTEXT)
    return Origin(kind="nemo2", nemo2_context=(ckpt / CONTEXT).resolve(),
                  tokenizer=tok.resolve() if tok is not None else None)


class Nemo2Format(TorchDistFormat):
    holds = HOLDS_LANGUAGE_MODEL
    name = "nemo2"
    iteration_dirs = False
    subdir = WEIGHTS  # the directory the weights are written to
    prefix = PREFIX

    def detect(self, path: Path) -> bool:
        return _looks_like(path)

    def index(self, path: Path, rt: Runtime, vocab_size: int | None) -> SourceIndex:
        return on_rank0(rt, lambda: self._index_nemo2(path, vocab_size))

    def _index_nemo2(self, path: Path, vocab_size: int | None) -> SourceIndex:
        if not _looks_like(path):
            raise ConvertError(f"{path} is not a NeMo 2 checkpoint (no {WEIGHTS}/ and {CONTEXT}/)",
                               "point SRC at the checkpoint directory that holds weights/ and context/, or pass "
                               "the right --src-format")
        md, common, style = open_weights(path / WEIGHTS, self.trust_pickle)
        args = nemo2_args(path, md)
        iteration = int(common.get("global_step") or 0) if isinstance(common.get("global_step"), int) else 0
        return self.index_weights(path / WEIGHTS, iteration, md, common, style, args, vocab_size, nemo2_origin(path))

    def target_files(self, target: Target, dtypes: dict) -> list[TargetFile]:
        check_context(target)
        return super().target_files(target, dtypes)

    def common_state(self, target: Target) -> dict[str, Any]:
        """Lightning's checkpoint keys as NeMo saves them with the weights (no optimizer or loop state)."""
        step = 0 if target.iteration == "release" else int(target.iteration)
        return {"epoch": 0, "global_step": step, "state_dict": {}, "content_metadata": {
            "singleton_local_shards": False, "chained_optim_avoid_prefix": True}}

    def finalize(self, target: Target, weights: Path, written: list[WrittenFile]) -> None:
        """The weights' metadata, then context/ carried from the source with the target's parallel fields."""
        super().finalize(target, weights, written)
        write_target_context(weights.parent / CONTEXT, target, self.options.tokenizer_dir)

    def package(self, tmp: Path, dst: Path) -> Path:
        return tmp


def _source_context(target: Target) -> Path | None:
    context = target.origin.nemo2_context
    return context if context is not None and context.is_dir() else None


def check_context(target: Target) -> None:
    """Refuse, before any work, a target whose context cannot be written."""
    if _source_context(target) is None:
        gpt_config(target, bridge_model_section(target.cfg, target.args))


def write_target_context(dst: Path, target: Target, tokenizer_dir: Path | None) -> None:
    """The target's context/: the NeMo 2 source's with the new layout, else one written from the model config
    (the tokenizer files from ``tokenizer_dir``, else the directory the source's args name)."""
    src = _source_context(target)
    if src is not None:
        write_context(src, dst, target)
        return
    write_fresh_context(dst, target, bridge_model_section(target.cfg, target.args),
                        tokenizer_source(target.origin, tokenizer_dir))


def write_context(src: Path, dst: Path, target: Target) -> None:
    """Copy NeMo's context/ and set the layout in model.yaml's config and in io.json's model config and
    trainer strategy."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    layout = target.layout
    if (src / MODEL_YAML).is_file():
        y = yaml.safe_load((src / MODEL_YAML).read_text()) or {}
        y["config"] = fields_for_target(y["config"], target.cfg, layout, target.dtype)
        write_durable(dst / MODEL_YAML, yaml.safe_dump(y, sort_keys=False))
    if (src / IO_JSON).is_file():
        g = FiddleGraph(src / IO_JSON)
        model = g.child(g.root, "model")
        config = g.child(model, "config") if model else None
        given = g.leaves(config) if config is not None else {}
        values = fields_for_target({"params_dtype": given.get("params_dtype")}, target.cfg, layout, target.dtype)
        if config is not None:
            for name in PARALLEL:
                if name in values and (values[name] is not None or name in g.items(config)):
                    g.set_leaf(config, name, values[name], "<root>.model.config")
            if "pipeline_dtype" in values and not given.get("pipeline_dtype"):
                g.set_leaf(config, "pipeline_dtype", None, "<root>.model.config",
                           pyref=values["pipeline_dtype"]["_target_"])
        trainer = g.child(g.root, "trainer")
        strategy = g.child(trainer, "strategy") if trainer else None
        if strategy is not None:
            for name, attr in STRATEGY.items():
                value = getattr(layout, attr)
                if value is not None or name in g.items(strategy):
                    g.set_leaf(strategy, name, value, "<root>.trainer.strategy")
            if "pipeline_dtype" in values and "pipeline_dtype" not in g.items(strategy):
                g.set_leaf(strategy, "pipeline_dtype", None, "<root>.trainer.strategy",
                           pyref=values["pipeline_dtype"]["_target_"])
        write_durable(dst / IO_JSON, json.dumps(g.doc, indent=2))
