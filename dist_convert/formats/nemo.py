"""NeMo ``.nemo`` checkpoints of megatron-core GPT models (``mcore_gpt: true``), as a tar archive or an
already extracted directory: ``model_config.yaml``, tokenizer artifacts, and one
``model_weights.ckpt`` per model-parallel rank (``model_weights.ckpt`` at TP=PP=1,
``mp_rank_TT/`` with PP=1, ``tp_rank_TT_pp_rank_PPP/`` otherwise) holding a plain state dict with
``model.``-prefixed megatron-core keys, layer numbers local to each pipeline stage.

Archives are read member by member (never extracted as a whole); a ``.nemo`` target is written as
an extracted directory, then streamed into one tar file.
"""
from __future__ import annotations

import argparse
import copy
import io
import re
import shutil
import tarfile
from pathlib import Path
from typing import IO, Any

import torch
import yaml

from ..config import ModelConfig, classify
from ..datamodel import Origin, SourceChunk, SourceIndex, Target, TargetFile, WrittenFile
from ..durable import copy_durable, fsync_file, write_durable
from ..errors import ConvertError
from ..features.base import as_tuple
from ..features.expressed import ANY, features_named, refuse_unexpressed, unheld
from ..features.position import LLAMA3_DEFAULT_FACTOR, Llama3
from ..integrity import is_run_state
from ..layout.topology import Layout
from ..runtime import Runtime
from ..safe_load import load_pt
from .base import HOLDS_LANGUAGE_MODEL, FormatOptions, KeyPolicy, add_rank_file_chunks
from .mcore_config import FIELDS as MCORE_FIELDS
from .mcore_config import PASSED, passed_fields
from .nemo_legacy import nemo_target_files, source_style, target_style
from .torch_zip import SavedFiles

CONFIG = "model_config.yaml"
WEIGHTS = "model_weights.ckpt"
PREFIX = "model."
_RANK_DIR = re.compile(r"^(?:mp_rank_(\d{2})|tp_rank_(\d{2})_pp_rank_(\d{3}))$")
# NeMo's activation names (nemo.collections.nlp.parts.utils_funcs.activation_to_func) -> (gated, MLP.activation);
# approx-gelu (x * sigmoid(1.702 x)) and the ReLU GLUs have no megatron-core Megatron-LM argument: refused
NEMO_ACTIVATIONS = {"gelu": (False, "gelu"), "geglu": (True, "gelu"), "fast-geglu": (True, "gelu"),
                    "swiglu": (True, "silu"), "fast-swiglu": (True, "silu"), "squared-relu": (False, "squared_relu")}
# (gated, MLP.activation) -> the name NeMo writes for it (a SwiGLU's: the caller's, split or fused)
NEMO_NAMES = {v: k for k, v in NEMO_ACTIVATIONS.items()}


def _nemo_mlp(gated: bool, activation: str) -> tuple[bool, str]:
    """(gated, activation) as NeMo says it: tanh GELU is its GELU with ``openai_gelu``."""
    return gated, "gelu" if activation == "gelu_tanh" else activation

# What model_config.yaml (megatron-core GPT and T5) says of a model in NeMo's own keys: RoPE (base, share) or learned /
# relative positions, llama3 RoPE scaling (scale_positional_embedding, megatron-core's factor), the norm, its epsilon,
# q/k layernorms, biases, the activations of NEMO_ACTIVATIONS (openai_gelu: tanh GELU)
NEMO_EXPRESSES = {"position.kind": {"rope", "learned_absolute", "relative"}, "position.base": ANY,
                  "position.percent": ANY, "position.scaling": {None, "llama3"},
                  "position.scaling.factor": {LLAMA3_DEFAULT_FACTOR}, "norm.kind": ANY, "norm.eps": ANY,
                  "attention.qk_norm": ANY, "add_bias_linear": ANY, "add_qkv_bias": ANY, "mlp.gated": ANY, "t5": ANY,
                  "mlp.activation": lambda act, cfg: _nemo_mlp(cfg.mlp.gated, act) in NEMO_NAMES}
# megatron-core names NeMo derives from its own keys (bias, qkv_bias, activation, normalization, the precision), not
# from the name itself (MegatronBaseModel.build_transformer_config)
_NEMO_DERIVED = {"activation_func", "gated_linear_unit", "add_bias_linear", "add_qkv_bias", "normalization",
                 "layernorm_zero_centered_gamma", "apply_layernorm_1p", "apply_residual_connection_post_layernorm",
                 "transformer_impl", "max_sequence_length", "rope_scaling", "rope_scaling_factor"}
_DTYPES = {"bf16": torch.bfloat16, "bf16-mixed": torch.bfloat16, "16": torch.float16, "16-mixed": torch.float16,
           "32": torch.float32}


def rank_file(t: int, p: int, layout: Layout) -> str:
    if layout.tp == 1 and layout.pp == 1:
        return WEIGHTS
    return f"mp_rank_{t:02d}/{WEIGHTS}" if layout.pp == 1 else f"tp_rank_{t:02d}_pp_rank_{p:03d}/{WEIGHTS}"


class Archive:
    """Read access to a .nemo tar or an extracted directory (paths relative to its root)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.is_tar = path.is_file()
        if self.is_tar:
            try:
                with tarfile.open(path, "r:*") as tar:
                    self._names = {m.name.removeprefix("./"): m.name for m in tar.getmembers() if m.isfile()}
            except (tarfile.TarError, OSError) as e:
                raise ConvertError(f"{path} is not a readable .nemo archive ({e})", "re-copy the archive") from None
        else:
            self._names = {str(p.relative_to(path)): str(p) for p in path.rglob("*") if p.is_file()}

    def names(self) -> list[str]:
        return sorted(self._names)

    def read_bytes(self, name: str) -> bytes:
        if not self.is_tar:
            return Path(self._names[name]).read_bytes()
        with tarfile.open(self.path, "r:*") as tar:
            f = tar.extractfile(self._names[name])
            assert f is not None
            return f.read()

    def load(self, name: str, trust_pickle: bool) -> Any:
        """A torch file of the archive: memory-mapped from a directory, streamed from a tar."""
        if not self.is_tar:
            return load_pt(Path(self._names[name]), trust_pickle)
        with tarfile.open(self.path, "r:*") as tar:
            member: IO[bytes] | None = tar.extractfile(self._names[name])
            assert member is not None
            return load_pt(self.path / name, trust_pickle, stream=io.BytesIO(member.read()))


T5_ARCH = ("hidden_size", "ffn_hidden_size", "num_attention_heads", "kv_channels", "activation", "normalization",
           "bias", "position_embedding_type", "relative_attention_num_buckets")


def t5_sections(y: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The encoder and decoder settings of a NeMo T5 config (``encoder:``/``decoder:`` over the top level)."""
    return {**y, **(y.get("encoder") or {})}, {**y, **(y.get("decoder") or {})}


def config_from_nemo(y: dict[str, Any], padded_vocab: int, vocab_size: int | None,
                     legacy: bool = False) -> tuple[ModelConfig, argparse.Namespace]:
    """Model config and Megatron-LM style args from a NeMo ``model_config.yaml`` (GPT, or T5 with ``mcore_t5``;
    ``legacy``: a legacy NeMo GPT, which reads no megatron-core names)."""
    if not y.get("mcore_t5"):
        return _config_from_nemo(y, padded_vocab, vocab_size, "gpt", legacy=legacy)
    enc, dec = t5_sections(y)
    differ = [k for k in T5_ARCH if enc.get(k) != dec.get(k)]
    if differ:
        raise ConvertError(f"the T5 encoder and decoder differ in {', '.join(differ)}",
                           "only T5 models whose encoder and decoder share one architecture convert")
    try:
        stacks = {"encoder_num_layers": int(enc["num_layers"]), "decoder_num_layers": int(dec["num_layers"])}
    except KeyError:
        raise ConvertError(f"{CONFIG} lacks encoder/decoder num_layers",
                           "use the model_config.yaml saved with the model") from None
    merged = {**dec, "share_embeddings_and_output_weights": y.get("share_decoder_tokens_head_embeddings", True)}
    return _config_from_nemo(merged, padded_vocab, vocab_size, "t5", stacks)


def _config_from_nemo(y: dict[str, Any], padded_vocab: int, vocab_size: int | None, family: str,
                      stacks: dict[str, int] | None = None,
                      legacy: bool = False) -> tuple[ModelConfig, argparse.Namespace]:
    try:
        heads, hidden, layers = int(y["num_attention_heads"]), int(y["hidden_size"]), int(y["num_layers"])
    except KeyError as e:
        raise ConvertError(f"{CONFIG} lacks {e.args[0]}", "use the model_config.yaml saved with the model") from None
    norm = str(y.get("normalization", "layernorm")).lower()
    if norm not in ("rmsnorm", "layernorm"):
        raise ConvertError(f"normalization={norm} is not supported", "only layernorm and rmsnorm convert")
    act = str(y.get("activation", "gelu")).lower()
    if act not in NEMO_ACTIVATIONS:
        raise ConvertError(f"activation={act}: megatron-core's Megatron-LM arguments have no such MLP",
                           f"convert a model whose activation is one of {', '.join(NEMO_ACTIVATIONS)}")
    gated, activation = NEMO_ACTIVATIONS[act]
    if y.get("openai_gelu"):  # NeMo gives it precedence over the named activation
        activation = "gelu_tanh"
    args = argparse.Namespace(
        num_layers=layers, hidden_size=hidden, ffn_hidden_size=int(y.get("ffn_hidden_size") or 4 * hidden),
        num_attention_heads=heads, num_query_groups=int(y.get("num_query_groups") or heads),
        kv_channels=int(y.get("kv_channels") or hidden // heads), swiglu=gated, glu_activation=activation,
        openai_gelu=not gated and activation == "gelu_tanh", squared_relu=activation == "squared_relu",
        normalization="RMSNorm" if norm == "rmsnorm" else "LayerNorm",
        norm_epsilon=float(y.get("layernorm_epsilon", 1e-5)), add_bias_linear=bool(y.get("bias", True)),
        hidden_dropout=float(y.get("hidden_dropout", 0.1)), attention_dropout=float(y.get("attention_dropout", 0.1)),
        add_qkv_bias=bool(y.get("qkv_bias", y.get("bias", True))), qk_layernorm=bool(y.get("qk_layernorm", False)),
        untie_embeddings_and_output_weights=not y.get("share_embeddings_and_output_weights", True),
        vocab_size=vocab_size, padded_vocab_size=padded_vocab,
        make_vocab_size_divisible_by=int(y.get("make_vocab_size_divisible_by", 128)),
        position_embedding_type=str(y.get("position_embedding_type", "learned_absolute")),
        max_position_embeddings=int(y.get("max_position_embeddings") or y.get("encoder_seq_length") or 2048),
        rotary_base=float(y.get("rotary_base", 10000)), rotary_percent=float(y.get("rotary_percentage", 1.0)),
        # NeMo reads an absent transformer_engine as False: local layer names
        transformer_impl="transformer_engine" if y.get("transformer_engine", False) else "local",
        params_dtype=_DTYPES.get(str(y.get("precision", "32")), torch.float32),
        relative_attention_num_buckets=int(y.get("relative_attention_num_buckets", 32)), **(stacks or {}))
    if y.get("scale_positional_embedding"):
        args.use_rope_scaling = True
    if not legacy:
        _pass_through(y, args)
    from ..config import config_from_args

    return config_from_args(args, vocab_size, None, 1, family), args


def _pass_through(y: dict[str, Any], args: argparse.Namespace) -> None:
    """The megatron-core TransformerConfig / GPTModel settings model_config.yaml holds under their own names, which
    NeMo hands to megatron-core as they stand (windows, softmax settings, RoPE interpolation, MoE routing, ...): set
    on ``args`` under their Megatron-LM names, so they are carried, or refused where dist_convert does not convert
    them."""
    for name, value in y.items():
        if value is None or name in _NEMO_DERIVED or classify(name)[0] not in ("read", "unconverted"):
            continue
        arg = MCORE_FIELDS.get(name, name)
        if getattr(args, arg, None) is None:  # not one this reader sets from NeMo's own keys
            setattr(args, arg, as_tuple(value))


def nemo_activation(cfg: ModelConfig, section: dict[str, Any], swiglu: str) -> dict[str, Any]:
    """``activation`` (and ``openai_gelu`` where it is set or was) of a model_config.yaml section for the model's
    MLP: the section's own spelling when it says the same, else NeMo's name for it (``swiglu``: a SwiGLU's)."""
    tanh = cfg.mlp.activation == "gelu_tanh"
    want = _nemo_mlp(cfg.mlp.gated, cfg.mlp.activation)
    current = section.get("activation")
    kept = isinstance(current, str) and NEMO_ACTIVATIONS.get(current.lower()) == want
    out: dict[str, Any] = {"activation": current if kept else swiglu if want == (True, "silu") else NEMO_NAMES[want]}
    if tanh or "openai_gelu" in section:
        out["openai_gelu"] = tanh
    return out


def _looks_like(path: Path) -> bool:
    if path.is_dir():
        return (path / CONFIG).is_file()
    return path.is_file() and path.suffix == ".nemo"


class NemoFormat:
    name = "nemo"
    iteration_dirs = False
    sharded = True
    any_writer = False
    row_blocks = False
    holds = tuple(f for f in HOLDS_LANGUAGE_MODEL if f != "moe")  # NeMo 1 GPT / T5 (MoE: not yet)

    def __init__(self, options: FormatOptions | None = None) -> None:
        self.options = options or FormatOptions()
        self.trust_pickle = self.options.trust_pickle
        self._archive: Archive | None = None
        self._config: dict[str, Any] = {}

    def detect(self, path: Path) -> bool:
        return _looks_like(path)

    def index(self, path: Path, rt: Runtime, vocab_size: int | None) -> SourceIndex:
        archive = Archive(path)
        if CONFIG not in archive.names():
            raise ConvertError(f"{path} has no {CONFIG}", "a .nemo archive needs its model_config.yaml; re-export it")
        y = yaml.safe_load(archive.read_bytes(CONFIG)) or {}
        tp, pp = int(y.get("tensor_model_parallel_size", 1)), int(y.get("pipeline_model_parallel_size", 1))
        if y.get("virtual_pipeline_model_parallel_size"):
            raise ConvertError("virtual pipeline .nemo checkpoints are not supported yet", "save without VPP")
        split = y.get("pipeline_model_parallel_split_rank") if y.get("mcore_t5") and pp > 1 else None
        layout = Layout(tp=tp, pp=pp, split=int(split) if split is not None else None)
        files = {(t, p): rank_file(t, p, layout) for t, p in layout.ranks()}
        for f in files.values():
            if f not in archive.names():
                raise ConvertError(f"{path}: {f} is missing (model_config.yaml says TP={tp} PP={pp})",
                                   "re-copy the complete archive")
        mine = {c: self._shapes(archive, f) for c, f in list(files.items())[rt.rank::rt.world]}
        shapes: dict[tuple[int, int], dict[str, Any]] = {}
        for part in rt.all_gather_object(mine):
            shapes.update(part)
        for c in files:
            if isinstance(shapes[c], str):
                raise ConvertError(shapes[c])
        style = source_style(y, shapes[(0, 0)])  # mcore or legacy NeMo keys (nemo_legacy.py)
        embed = shapes[(0, 0)].get(style.embedding_key)
        if embed is None:
            raise ConvertError(f"{files[(0, 0)]} has no {style.embedding_key}", "the archive is not a GPT model")
        cfg, args = config_from_nemo(y, embed[0][0] * tp, vocab_size, legacy=style.legacy)
        lacking = unheld(cfg, self.holds)  # what this reader holds, declared positively
        if lacking:
            raise ConvertError(f"{path}: model_config.yaml describes {features_named(lacking)}, which .nemo sources "
                               "are not read with yet",
                               "load it in NeMo and save it as a megatron-core (torch_dist) checkpoint first")
        cfg = cfg.replace(spec="te" if any("layer_norm_weight" in k for k in shapes[(0, 0)]) else "local")
        cfg.check_layout(layout, "source")
        chunks: list[SourceChunk] = []
        policy = KeyPolicy.of(self.options)
        for (t, p), rel in files.items():
            expected = style.entries(cfg, layout, t, p)
            add_rank_file_chunks(chunks, rel, expected, shapes[(t, p)], CONFIG, policy)
        args.tensor_model_parallel_size, args.pipeline_model_parallel_size = tp, pp
        args.pipeline_model_parallel_split_rank = layout.split
        self._archive = archive
        origin = Origin(kind=self.name, nemo_config=y, nemo_archive=path.resolve())  # a target's config, artifacts
        return policy.finish(SourceIndex(format=self.name, iter_dir=path, iteration="release", args=args, cfg=cfg,
                                         layout=layout, chunks=chunks, notes=[], origin=origin))

    def _shapes(self, archive: Archive, name: str) -> dict[str, Any] | str:
        """name -> (shape, dtype) of a rank file's tensors, or the error (every rank must reach the gather)."""
        try:
            sd = archive.load(name, self.trust_pickle)
        except ConvertError as e:
            return str(e)
        if not isinstance(sd, dict):
            return f"{name} is not a state dict; re-copy the archive"
        return {k: (tuple(v.shape), v.dtype) for k, v in sd.items()
                if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}

    def read(self, index: SourceIndex, chunks: list[SourceChunk]) -> dict[int, torch.Tensor]:
        archive = self._archive or Archive(index.iter_dir)
        by_file: dict[str, list[SourceChunk]] = {}
        for c in chunks:
            by_file.setdefault(c.file, []).append(c)
        out = {}
        for rel, group in by_file.items():
            sd = archive.load(rel, self.trust_pickle)
            out.update({c.id: sd[c.key] for c in group})
        return out

    def target_files(self, target: Target, dtypes: dict[str, torch.dtype]) -> list[TargetFile]:
        if target.layout.pipeline_layout is not None:
            raise ConvertError("pipeline layout strings in .nemo targets are not supported yet",
                               "write --dst-format torch_dist or megatron, or place layers evenly (--target-vpp 1 "
                               "replaces a source's layout string; drop --target-pipeline-layout)")
        if target.layout.vpp:
            raise ConvertError("virtual pipeline .nemo targets are not supported yet", "drop --target-vpp")
        legacy = target_style(self.options.nemo_style, target, target.cfg.family).legacy
        declared = NEMO_EXPRESSES if legacy else {**NEMO_EXPRESSES, **dict.fromkeys(PASSED, ANY)}
        refuse_unexpressed(target.cfg, declared,
                           "a legacy NeMo model's model_config.yaml" if legacy else "NeMo's model_config.yaml",
                           "write --dst-format torch_dist (megatron-core) or megatron instead")
        return nemo_target_files(target, dtypes, lambda t, p, e: rank_file(t, p, target.layout),
                                 self.options.nemo_style)

    def open_writer(self, target: Target, out_dir: Path, files: list[TargetFile], rt: Runtime) -> SavedFiles:
        return SavedFiles(out_dir, files, lambda f, tensors: {
            **{t.key: x for t, x in zip(f.tensors, tensors, strict=True)}, **f.objects})

    def finalize(self, target: Target, out_dir: Path, written: list[WrittenFile]) -> None:
        """Rank 0: model_config.yaml for the target layout, and the source's tokenizer artifacts."""
        y = copy.deepcopy(target.origin.nemo_config or {})
        cfg, layout = target.cfg, target.layout
        arch = dict(hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.ffn_hidden_size,
                    num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_query_groups,
                    kv_channels=cfg.kv_channels, position_embedding_type=cfg.position.kind,
                    normalization="rmsnorm" if cfg.norm.kind == "RMSNorm" else "layernorm",
                    bias=cfg.add_bias_linear, max_position_embeddings=cfg.max_position_embeddings,
                    layernorm_epsilon=cfg.norm.eps, qk_layernorm=cfg.attention.qk_norm)
        if cfg.add_qkv_bias != cfg.add_bias_linear or "qkv_bias" in y:
            arch["qkv_bias"] = cfg.add_qkv_bias
        if cfg.position.kind == "rope":
            arch.update(rotary_base=cfg.position.base, rotary_percentage=cfg.position.percent)
        if cfg.position.scaling or "scale_positional_embedding" in y:
            arch["scale_positional_embedding"] = isinstance(cfg.position.scaling, Llama3)
        arch.update(passed_fields(cfg, kept=y))  # megatron-core's own names (legacy targets: refused before)
        y.update(tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
                 make_vocab_size_divisible_by=cfg.make_vocab_size_divisible_by)
        if cfg.t5 is not None:  # NeMo's T5 config: one section per stack, the split rank at the top
            for name, layers in (("encoder", cfg.t5.encoder_num_layers), ("decoder", cfg.num_layers)):
                section = {**(y.get(name) or {}), **arch, "num_layers": layers}
                section.update(nemo_activation(cfg, section, "swiglu"))
                section.setdefault("relative_attention_num_buckets", cfg.t5.relative_attention_num_buckets)
                y[name] = section
            y.update(pipeline_model_parallel_split_rank=layout.split or 0, share_token_embeddings=True,
                     share_decoder_tokens_head_embeddings=cfg.tied)
        else:
            y.update(mcore_gpt=True, num_layers=cfg.num_layers, share_embeddings_and_output_weights=cfg.tied, **arch)
        y.update(target_style(self.options.nemo_style, target, cfg.family).config_updates(y))
        if cfg.t5 is None:
            y.update(nemo_activation(cfg, y, "fast-swiglu"))
        tokenizer = dict(y.get("tokenizer") or {})
        for key, path in (("model", self.options.tokenizer_model), ("vocab_file", self.options.tokenizer_vocab_file)):
            if path is not None:  # an override travels inside the archive, referenced the way NeMo does
                copy_durable(path, out_dir / path.name)
                tokenizer[key] = f"nemo:{path.name}"
        if tokenizer:
            y["tokenizer"] = tokenizer
        write_durable(out_dir / CONFIG, yaml.safe_dump(y, sort_keys=False))
        archive = target.origin.nemo_archive
        if archive is not None and archive.exists():  # tokenizer and other artifacts travel with the model
            source = Archive(archive)
            for name in source.names():
                if name != CONFIG and not name.endswith(WEIGHTS):
                    (out_dir / name).parent.mkdir(parents=True, exist_ok=True)
                    write_durable(out_dir / name, source.read_bytes(name))

    def package(self, tmp: Path, dst: Path) -> Path:
        """Rank 0: a ``.nemo`` target is streamed into one tar (members added file by file)."""
        if dst.suffix != ".nemo":
            return tmp
        packed = tmp.parent / (tmp.name + ".nemo")
        try:
            with tarfile.open(packed, "w:") as tar:
                for f in sorted(p for p in tmp.rglob("*") if p.is_file() and not is_run_state(p.relative_to(tmp))):
                    tar.add(f, arcname=f"./{f.relative_to(tmp)}")
            fsync_file(packed)
        except BaseException:
            packed.unlink(missing_ok=True)  # never leave a partial archive behind
            raise
        shutil.rmtree(tmp)
        return packed
