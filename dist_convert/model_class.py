"""The target's model class (``--target-model``): megatron-core's GPTModel or its successor HybridModel.

A HybridModel stack (megatron-core's ``models/hybrid``; MambaModel is one) has one sub-block per layer, named by its
pattern: ``*`` attention, ``+`` multi-latent attention, ``D`` DeepSeek sparse attention, ``G`` Gated DeltaNet, ``-``
MLP, ``E`` MoE, ``M`` Mamba2. A GPT layer ``n`` is two of them: its mixer (attention with the input norm, or Gated
DeltaNet) at hybrid layer ``2n`` and its MLP or MoE (with the pre-MLP norm) at ``2n + 1``, so the same model is
pattern ``*-*-…`` (``*E`` where layer ``n`` is MoE, ``G-`` where it is a Gated DeltaNet layer), its final norm is
``decoder.final_norm``, and each multi-token-prediction depth is such a pair after ``/``, its layers under
``mtp_model_layer.layers.0`` / ``.1``. Converting between the two classes renames
each logical tensor accordingly (``renamed``) and rewrites the model config (``hybrid_of`` / ``gpt_of``); the values
are the same tensors, bit for bit. Pure functions, tested without processes.
"""
from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Callable

from .config import ModelConfig
from .datamodel import SourceIndex
from .defaults import MODEL_CLASSES
from .errors import ConvertError
from .features.blocks import DSA_SYMBOL, GDN_SYMBOL, MLA_SYMBOL, MTP_SEPARATOR, Mamba, attention_symbol
from .layout.hybrid import HYBRID_MTP_LAYERS, MIXER_PARTS
from .layout.mtp import MTP_LAYER
from .layout.pipeline_layout import of_segments
from .layout.topology import Layout
from .optim.state import with_parameter

GPT, HYBRID = MODEL_CLASSES
MLP_PARTS = ("pre_mlp_layernorm.", "mlp.")  # a GPT layer's modules at its MLP / MoE position (MIXER_PARTS: the rest)
FINAL_NORM = {"decoder.final_layernorm.weight": "decoder.final_norm.weight"}
GPT_FINAL_NORM = {v: k for k, v in FINAL_NORM.items()}
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_GPT_MTP = re.compile(r"mtp\.layers\.(\d+)\." + re.escape(MTP_LAYER) + r"(.+)")
_HYBRID_MTP = re.compile(r"mtp\.layers\.(\d+)\." + re.escape(HYBRID_MTP_LAYERS) + r"\d+\.(.+)")
MAMBA_HEAD_DIM = 64  # the Mamba record's head size when the model has no Mamba2 layer (no tensor depends on it)


def model_class(cfg: ModelConfig) -> str:
    """The class a model config describes: a hybrid layer pattern makes it a HybridModel."""
    return HYBRID if cfg.mamba is not None else GPT


def _refuse_unplaced(cfg: ModelConfig) -> None:
    """What megatron-core's HybridModel has no place for as this converter places a GPT layer, in one line."""
    unplaced = [what for what, present in (
        ("DeepSeek-sparse-attention layers that reuse another layer's top-k (dsa_indexer_topk_freq > 1: "
         "megatron-core's hybrid stack numbers its layers otherwise)", cfg.dsa is not None and cfg.dsa.topk_freq > 1),
        ("multi-token prediction after a Gated DeltaNet last layer", cfg.mtp is not None and cfg.gdn is not None
         and bool(cfg.gdn.pattern[-1])),
        ("multi-latent attention without a q LoRA but with its latent norms (megatron-core 0.19's MLA then fuses a "
         "norm of its own into linear_q_proj, which the model has not)",
         cfg.mla is not None and cfg.mla.q_lora_rank is None and cfg.attention.qk_norm),
        ("a vision tower", cfg.vision is not None), ("an encoder (T5)", cfg.t5 is not None),
        ("full-width q/k norms", cfg.attention.qk_norm_full),
        (f"{cfg.norm.kind} (the hybrid stack's norms are converted as RMSNorm weights only)",
         cfg.norm.kind != "RMSNorm"),
        ("linear-layer biases", cfg.add_bias_linear or cfg.add_qkv_bias)) if present]
    if unplaced:
        raise ConvertError(f"--target-model hybrid: this model has {', '.join(unplaced)}, which dist_convert does not "
                           "place in a HybridModel yet (dense and MoE attention models with RMSNorm convert)",
                           "drop --target-model hybrid (or pass --target-model gpt) to keep a GPTModel checkpoint")


def hybrid_of(cfg: ModelConfig) -> ModelConfig:
    """A GPT model config as megatron-core's HybridModel of the same model: per GPT layer its mixer (the model's
    attention symbol, ``*`` ``+`` or ``D``, or ``G`` Gated DeltaNet) then its MLP (``-``, or ``E`` MoE); its MTP
    layers each a depth built like the last layer."""
    _refuse_unplaced(cfg)
    attention = attention_symbol(cfg)
    pattern = "".join((GDN_SYMBOL if cfg.layer_kind("decoder", n)[0] == "gdn" else attention)
                      + ("E" if cfg.is_moe_layer(n) else "-") for n in range(cfg.num_layers))
    mamba = Mamba(pattern=pattern, num_heads=max(1, 2 * cfg.hidden_size // MAMBA_HEAD_DIM), head_dim=MAMBA_HEAD_DIM)
    moe = cfg.moe and dataclasses.replace(cfg.moe, layer_pattern=None)  # the pattern says which layers are MoE
    if cfg.mtp is not None:  # each depth built like the last decoder layer: its pair of symbols
        mamba = dataclasses.replace(mamba, mtp_pattern=MTP_SEPARATOR.join([pattern[-2:]] * cfg.mtp.num_layers))
    gdn = cfg.gdn and dataclasses.replace(cfg.gdn, pattern=tuple(int(c == GDN_SYMBOL) for c in pattern))
    mla = cfg.mla and dataclasses.replace(cfg.mla, down_split=False)  # TE's spec replicates the down-projections
    return cfg.replace(num_layers=2 * cfg.num_layers, mamba=mamba, moe=moe, gdn=gdn, mla=mla, spec="te")


def gpt_of(cfg: ModelConfig) -> ModelConfig:
    """A HybridModel config as the GPTModel of the same model: its pattern must be attention then MLP / MoE, pair by
    pair."""
    assert cfg.mamba is not None
    p = cfg.mamba.pattern
    if len(p) % 2 or not set(p[0::2]) <= {"*", MLA_SYMBOL, DSA_SYMBOL, GDN_SYMBOL} or not set(p[1::2]) <= {"-", "E"}:
        raise ConvertError(f"--target-model gpt: the hybrid layer pattern {p!r} is not one attention (*, + or D) or "
                           "Gated DeltaNet (G) layer then one MLP (-) or MoE (E) layer, pair by pair, so no GPTModel "
                           "layer stack holds it", "drop --target-model gpt (keep the HybridModel checkpoint)")
    depths = cfg.mamba.mtp_pattern.split(MTP_SEPARATOR) if cfg.mamba.mtp_pattern else []
    if any(depth != p[-2:] or depth[0] == GDN_SYMBOL for depth in depths):
        raise ConvertError(f"--target-model gpt: the hybrid model's multi-token-prediction depths "
                           f"({cfg.mamba.mtp_pattern}) are not attention layers built like its last layer ({p[-2:]}), "
                           "as GPTModel builds its MTP layers",
                           "drop --target-model gpt (keep the HybridModel checkpoint)")
    moe_layers = tuple(int(c == "E") for c in p[1::2])
    moe = cfg.moe and dataclasses.replace(cfg.moe, layer_pattern=None if all(moe_layers) else moe_layers)
    gdn = cfg.gdn and dataclasses.replace(cfg.gdn, pattern=tuple(int(c == GDN_SYMBOL) for c in p[0::2]))
    return cfg.replace(num_layers=len(p) // 2, mamba=None, moe=moe, gdn=gdn)


SYMBOL_NAMES = {"M": "Mamba2", "G": "Gated DeltaNet", "*": "attention", MLA_SYMBOL: "MLA", DSA_SYMBOL: "DSA",
                "-": "MLP", "E": "MoE"}


def describe_class(cfg: ModelConfig, stage_layers: list[int]) -> str:
    """What ``inspect`` says of the model's class: a HybridModel's pattern (per pipeline stage, ``|`` between them,
    as megatron-core writes pipeline segments; its multi-token-prediction depths after ``/``) and its layers by kind."""
    if model_class(cfg) == GPT:
        return "GPTModel"
    p = cfg.mamba.pattern
    ends = list(itertools.accumulate(stage_layers))
    segments = "|".join(p[a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True))
    mtp = f"{MTP_SEPARATOR}{cfg.mamba.mtp_pattern}" if cfg.mamba.mtp_pattern else ""
    kinds = ", ".join(f"{p.count(s)} {name}" for s, name in SYMBOL_NAMES.items() if s in p)
    depths = f"; {cfg.mtp_num_layers} multi-token-prediction depth(s) after '{MTP_SEPARATOR}'" if mtp else ""
    return f"HybridModel, pattern {segments}{mtp}: {kinds}{depths}"


def gpt_to_hybrid_name(name: str) -> str:
    if mtp := _GPT_MTP.fullmatch(name):  # an MTP depth's layer: its mixer and MLP layers (HYBRID_MTP_LAYERS 0, 1)
        part = 0 if mtp[2].startswith(MIXER_PARTS) else 1
        return f"mtp.layers.{mtp[1]}.{HYBRID_MTP_LAYERS}{part}.{mtp[2]}"
    m = _LAYER.fullmatch(name)
    if m is None:
        return FINAL_NORM.get(name, name)
    n, rest = int(m[1]), m[2]
    if rest.startswith(MIXER_PARTS):
        return f"decoder.layers.{2 * n}.{rest}"
    if rest.startswith(MLP_PARTS):
        return f"decoder.layers.{2 * n + 1}.{rest}"
    raise ConvertError(f"--target-model hybrid: GPT layer tensor {name} belongs to neither the attention nor the MLP "
                       "sub-block of a HybridModel layer", "drop --target-model hybrid")


def hybrid_to_gpt_name(name: str) -> str:
    if mtp := _HYBRID_MTP.fullmatch(name):
        return f"mtp.layers.{mtp[1]}.{MTP_LAYER}{mtp[2]}"
    m = _LAYER.fullmatch(name)
    if m is None:
        return GPT_FINAL_NORM.get(name, name)
    return f"decoder.layers.{int(m[1]) // 2}.{m[2]}"


def renamed(index: SourceIndex, cfg: ModelConfig, rename: Callable[[str], str]) -> SourceIndex:
    """The source read as the model ``cfg`` describes: each piece's logical tensor renamed (an optimizer state's with
    its parameter), its pipeline stages counted in the target's layers (``carried_layout``)."""
    def name(logical: str) -> str:
        return with_parameter(logical, rename)

    chunks = [dataclasses.replace(c, pieces=[dataclasses.replace(p, logical=name(p.logical)) for p in c.pieces])
              for c in index.chunks]
    layout = carried_layout(index.layout, index.cfg.num_layers, cfg.num_layers, cfg.mtp_num_layers)
    return dataclasses.replace(index, cfg=cfg, chunks=chunks, layout=layout,
                               absent=frozenset(name(n) for n in index.absent))


def staged(layout: Layout) -> bool:
    """Whether ``layout`` places the layers on its pipeline stages other than evenly."""
    return any(x is not None for x in (layout.vpp, layout.first, layout.last, layout.pipeline_layout))


def carried_layout(src: Layout, layers: int, target_layers: int, mtp_layers: int) -> Layout:
    """The source's pipeline stages in the target class's layers (a GPT layer is two hybrid layers): uneven first /
    last stage sizes and each model chunk scaled, a layout string as the string of the scaled chunks (embedding
    first, MTP and loss last: where a HybridModel has them); plain PP where a stage would split a GPT layer."""
    plain = Layout(tp=src.tp, pp=src.pp, ep=src.ep, etp=src.etp, split=src.split)
    sizes = src.segment_sizes(layers) + [n for n in (src.first, src.last) if n is not None]
    if src.pp == 1 or any(n * target_layers % layers for n in sizes):
        return plain

    def scaled(n: int | None) -> int | None:
        return None if n is None else n * target_layers // layers

    if src.pipeline_layout is not None:
        chunks = [scaled(n) or 0 for n in src.segment_sizes(layers)]
        return dataclasses.replace(plain, vpp=src.vpp, pipeline_layout=of_segments(chunks, mtp_layers))
    return dataclasses.replace(plain, vpp=src.vpp, first=scaled(src.first), last=scaled(src.last))


def gpt_shaped(cfg: ModelConfig) -> bool:
    """A HybridModel whose layers pair up as GPT layers (attention, then MLP / MoE), with nothing else."""
    try:
        gpt_of(cfg)
    except ConvertError:
        return False
    return True


def as_model_class(index: SourceIndex, target: str | None, dst_format: str | None = None) -> SourceIndex:
    """The source index as the ``target`` class's model (None: the source's own class; for an HF target, a GPTModel
    where the source is a GPT-shaped HybridModel no HF family expresses as it is), refused in one line where that
    class cannot hold it; the notes say what changed."""
    source = model_class(index.cfg)
    if target is None and dst_format == "hf" and source == HYBRID and gpt_shaped(index.cfg):
        from .models import expressing_family  # the HF families, imported only for an HF target

        target = GPT if expressing_family(index.cfg, index.origin.hf_config) is None else None
    if target is None or target == source:
        return index
    if index.adapter is not None:
        raise ConvertError(f"--target-model {target}: adapters are converted within one model class only",
                           "merge it into the base model with --lora ADAPTER, or drop --target-model")
    if target == HYBRID:
        cfg, rename = hybrid_of(index.cfg), gpt_to_hybrid_name
    else:
        cfg, rename = gpt_of(index.cfg), hybrid_to_gpt_name
    out = renamed(index, cfg, rename)
    if staged(index.layout) and not staged(out.layout):
        out.notes.append(f"the source's pipeline stages ({index.layout}) split a GPT layer (its attention and its MLP "
                         "on two stages): the target splits PP evenly unless --target-pipeline-layout or "
                         "--target-num-layers-in-first/last-stage place the layers")
    out.notes.append(f"model class: {source} -> {target} ({index.cfg.num_layers} -> {cfg.num_layers} layers"
                     + (f", hybrid layer pattern {cfg.mamba.full_pattern}" if cfg.mamba is not None else "") + ")")
    return out
