"""The two key styles of NeMo 1 GPT ``.nemo`` rank files, as pure translations to pieces of the
canonical (megatron-core) logical tensors, so the planner reshards either style with no special case.

* **mcore** (``mcore_gpt: true``): megatron-core keys prefixed ``model.`` (``model.decoder.layers.N...``).
* **legacy** NeMo Megatron (``mcore_gpt`` false or absent): ``model.language_model.embedding...``,
  ``model.language_model.encoder.layers.N.{input_layernorm, self_attention.query_key_value,
  self_attention.dense, post_attention_layernorm, mlp.dense_h_to_4h, mlp.dense_4h_to_h}``,
  ``model.language_model.encoder.final_layernorm``, ``model.language_model.output_layer`` (untied),
  ``model.word_embeddings.weight`` (tied embedding copy on the last stage with PP > 1) and the rotary
  ``model.language_model.rotary_pos_emb.inv_freq`` buffer on every stage. Layer numbers are local to
  each pipeline stage, as in megatron-core rank files.

Layouts (NeMo's legacy ``nemo/collections/nlp/modules/common/megatron/``): ``query_key_value`` rows per
TP rank are per head ``[q_h; k_h; v_h]`` (megatron-core's order; there is no GQA in legacy NeMo), or,
with ``megatron_legacy: true``, ``[all local q heads; all local k heads; all local v heads]``
(``ParallelAttention._transpose_last_dim(mixed_x_layer, 3, True)``). Gated MLPs: ``fast-swiglu`` /
``fast-geglu`` / ``fast-reglu`` keep one ``dense_h_to_4h`` of ``[gate_r; up_r]`` per rank (as
megatron-core's ``linear_fc1``); ``swiglu`` / ``geglu`` / ``reglu`` store the gate in ``dense_h_to_4h`` and
the up projection in ``dense_h_to_4h_2``.

Source of truth: NVIDIA/NeMo at b558360b (the last commit with the legacy modules):
``modules/common/megatron/attention.py`` (ParallelAttention: query_key_value, dense, _transpose_last_dim),
``mlp.py`` (ParallelMLP: dense_h_to_4h[_2], dense_4h_to_h), ``transformer.py`` (layer norms, final_layernorm,
even layer split), ``language_model.py`` (embedding, rotary_pos_emb, output_layer), ``module.py``
(word_embeddings on the last stage), ``models/language_modeling/megatron_gpt_model.py`` (no GQA without
mcore), and ``scripts/checkpoint_converters/convert_gpt_nemo_to_mcore.py`` (build_key_mapping).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..config import ModelConfig
from ..datamodel import Target, TargetFile, TargetTensor, target_dtype
from ..errors import ConvertError
from ..features import Linear, Llama3
from ..layout.boxes import Box, Piece
from ..layout.fused import QKV, glu
from ..layout.rules import EMBEDDING, OUTPUT
from ..layout.topology import Layout
from .megatron import rank_entries, rank_target_files

Entry = tuple[tuple[int, ...], list[Piece]]
PREFIX = "model."
T5_PREFIX = "enc_dec_model."  # NeMo's MegatronT5Model keeps its megatron-core T5Model as enc_dec_model
LEGACY_EMBEDDING = "model.language_model.embedding.word_embeddings.weight"
INV_FREQ = "model.language_model.rotary_pos_emb.inv_freq"
STYLES = ("mcore", "legacy", "megatron_legacy")
SPLIT_GLU = ("swiglu", "geglu", "reglu")
FUSED_GLU = ("fast-swiglu", "fast-geglu", "fast-reglu")
PLAIN = ("gelu", "approx-gelu", "squared-relu")
_MCORE_TOPS = ("model.decoder.", "model.embedding.", "model.output_layer.")
_LAYER = "decoder.layers."
# megatron-core local-spec names -> legacy NeMo names (after ``model.``), per layer and top-level
LAYER_NAMES = {"input_layernorm": "input_layernorm", "self_attention.linear_qkv": "self_attention.query_key_value",
               "self_attention.linear_proj": "self_attention.dense", "pre_mlp_layernorm": "post_attention_layernorm",
               "mlp.linear_fc1": "mlp.dense_h_to_4h", "mlp.linear_fc2": "mlp.dense_4h_to_h"}
TOP_NAMES = {EMBEDDING: "language_model.embedding.word_embeddings.weight",
             "embedding.position_embeddings.weight": "language_model.embedding.position_embeddings.weight",
             "decoder.final_layernorm.weight": "language_model.encoder.final_layernorm.weight",
             "decoder.final_layernorm.bias": "language_model.encoder.final_layernorm.bias",
             OUTPUT: "language_model.output_layer.weight"}
TIED_HEAD = "word_embeddings.weight"  # the last stage's copy of a tied embedding (NeMo's MegatronModule)
_TO_MCORE = "write a megatron-core .nemo instead (--nemo-style mcore) or another --dst-format"


@dataclass(frozen=True)
class NemoStyle:
    """How a .nemo stores its tensors (see the module docstring)."""

    legacy: bool = False
    megatron_legacy: bool = False  # legacy QKV rows per TP rank: [q heads; k heads; v heads]
    split_glu: bool = False  # gated MLP as dense_h_to_4h (gate) + dense_h_to_4h_2 (up)
    is_target: bool = False  # refusals name the fix for a target (--nemo-style) rather than a source
    prefix: str = PREFIX  # of megatron-core keys: model. (GPT) or enc_dec_model. (T5, mcore_t5: true)

    @property
    def embedding_key(self) -> str:
        return LEGACY_EMBEDDING if self.legacy else self.prefix + EMBEDDING

    def entries(self, cfg: ModelConfig, layout: Layout, t: int, p: int) -> dict[str, Entry]:
        """Pure: every tensor of rank file (t, p): key -> (stored shape, pieces). Buffers have no pieces."""
        if not self.legacy:
            return {self.prefix + k: v for k, v in rank_entries(cfg, layout, t, p, cfg.spec).items()}
        out = legacy_entries(cfg, layout, t, p, self)
        out.update({k: (tuple(v.shape), []) for k, v in self.buffers(cfg).items()})
        return out

    def buffers(self, cfg: ModelConfig) -> dict[str, torch.Tensor]:
        """Non-weight state legacy NeMo saves on every stage: the rotary ``inv_freq`` (RotaryEmbedding)."""
        if not self.legacy or cfg.position.kind != "rope":
            return {}
        pos = cfg.position
        dim = int(cfg.kv_channels * pos.percent) if pos.percent < 1 else cfg.kv_channels
        return {INV_FREQ: 1.0 / (float(pos.base) ** (torch.arange(0, dim, 2).float() / dim))}

    def config_updates(self, y: dict[str, Any]) -> dict[str, Any]:
        """model_config.yaml entries that select this style in NeMo."""
        if self.prefix == T5_PREFIX:
            return {"mcore_t5": True}
        out: dict[str, Any] = {"mcore_gpt": not self.legacy}
        if self.legacy:
            out.update(megatron_legacy=self.megatron_legacy, transformer_engine=False)
        elif "megatron_legacy" in y:
            out["megatron_legacy"] = False
        return out


def move_rows(pieces: list[Piece], moves: list[tuple[int, int, int]]) -> list[Piece]:
    """Pieces after moving stored rows: each ``(src, dst, n)`` puts stored rows [src, src+n) at [dst, dst+n).
    Rows no move covers are dropped."""
    out = []
    for pc in pieces:
        assert len(pc.sbox.offsets) == len(pc.lbox.offsets), "rank-file pieces have no leading axes"
        a, m = pc.sbox.offsets[0], pc.sbox.sizes[0]
        for src, dst, n in moves:
            lo, hi = max(a, src), min(a + m, src + n)
            if hi <= lo:
                continue
            lbox = Box((pc.lbox.offsets[0] + lo - a,) + pc.lbox.offsets[1:], (hi - lo,) + pc.lbox.sizes[1:])
            sbox = Box((dst + lo - src,) + pc.sbox.offsets[1:], (hi - lo,) + pc.sbox.sizes[1:])
            out.append(Piece(pc.logical, lbox, sbox))
    return out


def qkv_moves(heads: int, head_dim: int) -> list[tuple[int, int, int]]:
    """megatron-core rows of one TP rank (head h: [q_h; k_h; v_h]; no GQA in legacy NeMo, one group per
    head) -> ``megatron_legacy`` rows ([all q; all k; all v])."""
    return QKV(heads=heads, groups=heads, head_dim=head_dim).moves(QKV.parts)


def legacy_name(key: str, tied_copy: bool) -> str:
    """Legacy NeMo key (with ``model.``) of a megatron-core local-spec rank-file key."""
    if key.startswith(_LAYER):
        num, _, rest = key[len(_LAYER):].partition(".")
        module, _, param = rest.rpartition(".")
        if module not in LAYER_NAMES:
            raise ConvertError(f"{module} has no legacy NeMo counterpart", _TO_MCORE)
        return f"{PREFIX}language_model.encoder.layers.{num}.{LAYER_NAMES[module]}.{param}"
    if key == OUTPUT and tied_copy:
        return PREFIX + TIED_HEAD
    if key not in TOP_NAMES:
        raise ConvertError(f"{key} has no legacy NeMo counterpart", _TO_MCORE)
    return PREFIX + TOP_NAMES[key]


def legacy_entries(cfg: ModelConfig, layout: Layout, t: int, p: int, style: NemoStyle) -> dict[str, Entry]:
    """Pure: the weight tensors of legacy rank file (t, p): key -> (stored shape, pieces)."""
    check_legacy_model(cfg, layout, _TO_MCORE if style.is_target else
                       "model_config.yaml does not describe a legacy NeMo GPT; check it")
    out: dict[str, Entry] = {}
    heads = cfg.num_attention_heads // layout.tp
    for key, (shape, pieces) in rank_entries(cfg, layout, t, p, "local").items():
        name = legacy_name(key, cfg.tied)
        if style.megatron_legacy and ".self_attention.linear_qkv." in key:
            out[name] = (shape, move_rows(pieces, qkv_moves(heads, cfg.kv_channels)))
        elif style.split_glu and ".mlp.linear_fc1." in key:
            local = glu(shape[0])  # this rank's [gate_r; up_r]
            part = local.part_shape(shape, "gate")
            out[name] = (part, move_rows(pieces, local.moves(("gate",))))
            out[name.replace(".dense_h_to_4h.", ".dense_h_to_4h_2.")] = (part, move_rows(pieces, local.moves(("up",))))
        else:
            out[name] = (shape, pieces)
    return out


def check_legacy_model(cfg: ModelConfig, layout: Layout, fix: str) -> None:
    """Refuse models legacy NeMo GPT cannot hold (``fix``: what to do about it)."""
    if getattr(cfg, "family", "gpt") != "gpt":
        raise ConvertError(f"legacy NeMo key style is supported for GPT models only, not {cfg.family}", fix)
    if cfg.num_query_groups != cfg.num_attention_heads:
        raise ConvertError(f"legacy NeMo GPT has no grouped-query attention (num_query_groups="
                           f"{cfg.num_query_groups}, heads={cfg.num_attention_heads})", fix)
    if cfg.attention.qk_norm:
        raise ConvertError("legacy NeMo GPT has no q/k layernorm", fix)
    if cfg.add_qkv_bias != cfg.add_bias_linear:
        raise ConvertError("legacy NeMo GPT has a QKV bias exactly when its linear layers have biases", fix)
    if cfg.position.kind not in ("learned_absolute", "rope"):
        raise ConvertError(f"position_embedding_type={cfg.position.kind} is not supported in legacy "
                           "NeMo .nemo files here", fix)
    if layout.first is not None or layout.last is not None:
        raise ConvertError("legacy NeMo GPT splits layers evenly over pipeline stages",
                           "drop --target-num-layers-in-first-stage/--target-num-layers-in-last-stage, or "
                           "--nemo-style mcore")


def source_style(y: dict[str, Any], keys: dict[str, Any]) -> NemoStyle:
    """The style of a .nemo from its model_config.yaml, checked against the keys of its first rank file."""
    if y.get("mcore_t5", False):
        return NemoStyle(prefix=T5_PREFIX)
    if any(k.startswith(T5_PREFIX) for k in keys):
        raise _refuse("an encoder-decoder (T5) model not based on megatron-core (mcore_t5 is not true)")
    legacy_keys = any(k.startswith(PREFIX + "language_model.") for k in keys)
    mcore_keys = any(k.startswith(_MCORE_TOPS) for k in keys)
    if y.get("mcore_gpt", False):
        if legacy_keys and not mcore_keys:
            raise ConvertError("model_config.yaml says mcore_gpt: true but the weights use legacy NeMo keys "
                               "(model.language_model...)", "set mcore_gpt: false in model_config.yaml")
        return NemoStyle()
    if mcore_keys and not legacy_keys:
        raise ConvertError("model_config.yaml says the model is not megatron-core based (mcore_gpt is not true) "
                           "but the weights use megatron-core keys (model.decoder...)",
                           "set mcore_gpt: true in model_config.yaml")
    return _legacy_source(y)


def _refuse(what: str) -> ConvertError:
    return ConvertError(f"legacy NeMo (mcore_gpt: false) with {what} is not supported",
                        "convert the model with NeMo first "
                        "(scripts/checkpoint_converters/convert_gpt_nemo_to_mcore.py)")


def _legacy_source(y: dict[str, Any]) -> NemoStyle:
    heads = y.get("num_attention_heads")
    groups = y.get("num_query_groups")
    if groups is not None and heads is not None and int(groups) != int(heads):
        raise ConvertError(f"num_query_groups={groups} with mcore_gpt: false: legacy NeMo GPT has no grouped-query "
                           "attention (NeMo refuses it too)", "set mcore_gpt: true if the weights are megatron-core's")
    act = str(y.get("activation", "gelu")).lower()
    checks = [(bool(y.get("transformer_engine", False)), "transformer_engine: true (Transformer Engine layer keys)"),
              (bool(y.get("headscale", False)), "headscale: true"),
              (y.get("normalize_attention_scores", True) is False,
               "normalize_attention_scores: false (attention scores not scaled by 1/sqrt(head size))"),
              (str(y.get("transformer_block_type", "pre_ln")) != "pre_ln",
               f"transformer_block_type: {y.get('transformer_block_type')}"),
              (str(y.get("position_embedding_type", "learned_absolute")) not in ("learned_absolute", "rope"),
               f"position_embedding_type: {y.get('position_embedding_type')}"),
              (int(y.get("num_moe_experts") or 1) > 1, "num_moe_experts > 1"),
              (act not in SPLIT_GLU + FUSED_GLU + PLAIN, f"activation: {act}")]
    for bad, what in checks:
        if bad:
            raise _refuse(what)
    return NemoStyle(True, bool(y.get("megatron_legacy", False)), act in SPLIT_GLU)


def target_style(option: str | None, target: Target, family: str = "gpt") -> NemoStyle:
    """The style of a .nemo target: ``--nemo-style``, else that of the .nemo the model came from (its Origin's
    model_config.yaml), else mcore. T5 models are written the megatron-core way only (``mcore_t5: true``)."""
    y = target.origin.nemo_config or {}
    if family == "t5":
        if option not in (None, "mcore"):
            raise ConvertError(f"--nemo-style {option} is for GPT models; T5 .nemo files are written with "
                               "megatron-core keys (mcore_t5: true)", "drop --nemo-style or pass --nemo-style mcore")
        return NemoStyle(prefix=T5_PREFIX, is_target=True)
    if option is None:
        src_legacy = bool(y) and not y.get("mcore_gpt", False)
        option = ("megatron_legacy" if y.get("megatron_legacy") else "legacy") if src_legacy else "mcore"
    if option not in STYLES:
        raise ConvertError(f"unknown --nemo-style {option}", f"use one of {', '.join(STYLES)}")
    act = str(y.get("activation", "")).lower()
    return NemoStyle(option != "mcore", option == "megatron_legacy", act in SPLIT_GLU, is_target=True)


def nemo_target_files(target: Target, dtypes: dict[str, torch.dtype], file_name: Callable[[int, int, int], str],
                      option: str | None) -> list[TargetFile]:
    """Pure: the rank files of a .nemo target in its style (``option``: ``--nemo-style``)."""
    style = target_style(option, target, target.cfg.family)
    if not style.legacy:
        return rank_target_files(target, dtypes, file_name, style.prefix)
    cfg, layout = target.cfg, target.layout
    if isinstance(target.cfg.position.scaling, (Llama3, Linear)):
        raise ConvertError("legacy NeMo GPT has no RoPE scaling (use_rope_scaling)", _TO_MCORE)
    style = replace(style, split_glu=style.split_glu and cfg.mlp.gated)
    files = []
    for t, p in layout.ranks():
        tensors = []
        for key, (shape, pieces) in legacy_entries(cfg, layout, t, p, style).items():
            # a rank holding only vocabulary padding rows has no pieces: its dtype is the embedding's
            logical = pieces[0].logical if pieces else (OUTPUT if key.endswith("output_layer.weight") else EMBEDDING)
            tensors.append(TargetTensor(key=key, shape=shape, dtype=target_dtype(target, dtypes, logical),
                                        pieces=pieces))
        files.append(TargetFile(id=len(files), name=file_name(t, p, 0), tensors=tensors,
                                objects=dict(style.buffers(cfg))))
    return files
