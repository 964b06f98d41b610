"""The one declarative layout table of GPT checkpoints, and the names each format stores them under.

A logical tensor is one unsharded tensor in canonical megatron-core naming (local-spec module
names) with a global layer number, e.g. ``decoder.layers.17.self_attention.linear_qkv.weight``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from ..config import ModelConfig
from .boxes import Kind

Cond = Callable[[ModelConfig], bool]
Shape = Callable[[ModelConfig], tuple[int, ...]]

_always: Cond = lambda c: True  # noqa: E731
_norm_bias: Cond = lambda c: c.has_norm_bias  # noqa: E731
_bias: Cond = lambda c: c.add_bias_linear  # noqa: E731
_h: Shape = lambda c: (c.hidden_size,)  # noqa: E731


@dataclass(frozen=True)
class Rule:
    name: str  # per-layer suffix (after decoder.layers.N.) or a full top-level name
    kind: Kind
    shape: Shape
    when: Cond = _always
    te_name: str | None = None  # name in Transformer Engine fused layer specs (and torch_dist keys)


# Per-layer tensors: suffix after ``decoder.layers.<N>.``
LAYER_RULES: tuple[Rule, ...] = (
    Rule("input_layernorm.weight", Kind.REP, _h, te_name="self_attention.linear_qkv.layer_norm_weight"),
    Rule("input_layernorm.bias", Kind.REP, _h, _norm_bias, te_name="self_attention.linear_qkv.layer_norm_bias"),
    Rule("self_attention.linear_qkv.weight", Kind.COL, lambda c: (c.qkv_rows, c.hidden_size)),
    Rule("self_attention.linear_qkv.bias", Kind.COL, lambda c: (c.qkv_rows,), lambda c: c.add_qkv_bias),
    Rule("self_attention.q_layernorm.weight", Kind.REP, lambda c: (c.kv_channels,), lambda c: c.qk_layernorm),
    Rule("self_attention.q_layernorm.bias", Kind.REP, lambda c: (c.kv_channels,),
         lambda c: c.qk_layernorm and c.has_norm_bias),
    Rule("self_attention.k_layernorm.weight", Kind.REP, lambda c: (c.kv_channels,), lambda c: c.qk_layernorm),
    Rule("self_attention.k_layernorm.bias", Kind.REP, lambda c: (c.kv_channels,),
         lambda c: c.qk_layernorm and c.has_norm_bias),
    Rule("self_attention.linear_proj.weight", Kind.ROW,
         lambda c: (c.hidden_size, c.num_attention_heads * c.kv_channels)),
    Rule("self_attention.linear_proj.bias", Kind.REP, _h, _bias),
    Rule("pre_mlp_layernorm.weight", Kind.REP, _h, te_name="mlp.linear_fc1.layer_norm_weight"),
    Rule("pre_mlp_layernorm.bias", Kind.REP, _h, _norm_bias, te_name="mlp.linear_fc1.layer_norm_bias"),
    Rule("mlp.linear_fc1.weight", Kind.COL, lambda c: (c.fc1_rows, c.hidden_size)),
    Rule("mlp.linear_fc1.bias", Kind.COL, lambda c: (c.fc1_rows,), _bias),
    Rule("mlp.linear_fc2.weight", Kind.ROW, lambda c: (c.hidden_size, c.ffn_hidden_size)),
    Rule("mlp.linear_fc2.bias", Kind.REP, _h, _bias),
)

# Top-level tensors and the pipeline stage that holds them ("first" or "last").
TOP_RULES: tuple[tuple[Rule, str], ...] = (
    (Rule("embedding.word_embeddings.weight", Kind.VOCAB, lambda c: (c.vocab_size, c.hidden_size)), "first"),
    (Rule("embedding.position_embeddings.weight", Kind.REP,
          lambda c: (c.max_position_embeddings or 0, c.hidden_size),
          lambda c: c.position_embedding_type == "learned_absolute"), "first"),
    (Rule("decoder.final_layernorm.weight", Kind.REP, _h), "last"),
    (Rule("decoder.final_layernorm.bias", Kind.REP, _h, _norm_bias), "last"),
    (Rule("output_layer.weight", Kind.VOCAB, lambda c: (c.vocab_size, c.hidden_size),
          lambda c: c.untie_embeddings_and_output_weights), "last"),
)

# Modules whose ``_extra_state`` megatron-core stores (None for the local spec, FP8 metadata for TE).
EXTRA_STATE_MODULES = {
    "local": ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"),
    "te": ("self_attention.linear_qkv", "self_attention.core_attention", "self_attention.linear_proj",
           "mlp.linear_fc1", "mlp.linear_fc2"),
}

EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"
LAYER_PREFIX = "decoder.layers."
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class LogicalTensor:
    name: str
    kind: Kind
    shape: tuple[int, ...]
    layer: int | None  # global layer number, None for top-level tensors
    suffix: str  # rule name: per-layer suffix or the top-level name
    stage: str  # "layer", "first" or "last"
    te_name: str | None


def effective_kind(rule: Rule, cfg: ModelConfig) -> Kind:
    if rule.kind is Kind.COL and rule.name.startswith("mlp.linear_fc1") and cfg.swiglu:
        return Kind.GLU
    return rule.kind


def logical_tensors(cfg: ModelConfig) -> dict[str, LogicalTensor]:
    """Every logical tensor of the model, in a stable order."""
    out: dict[str, LogicalTensor] = {}
    for rule, stage in TOP_RULES:
        if rule.name.startswith("decoder.") or not rule.when(cfg):
            continue
        out[rule.name] = LogicalTensor(rule.name, rule.kind, rule.shape(cfg), None, rule.name, stage, None)
    for layer in range(cfg.num_layers):
        for rule in LAYER_RULES:
            if rule.when(cfg):
                name = f"{LAYER_PREFIX}{layer}.{rule.name}"
                out[name] = LogicalTensor(name, effective_kind(rule, cfg), rule.shape(cfg), layer,
                                          rule.name, "layer", rule.te_name)
    for rule, stage in TOP_RULES:
        if rule.name.startswith("decoder.") and rule.when(cfg):
            out[rule.name] = LogicalTensor(rule.name, rule.kind, rule.shape(cfg), None, rule.name, stage, None)
    return out


def split_layer_name(name: str) -> tuple[int, str] | None:
    m = _LAYER_RE.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


def spec_suffix(t: LogicalTensor, spec: str) -> str:
    return t.te_name if (spec == "te" and t.te_name) else t.suffix


def torch_dist_key(t: LogicalTensor) -> str:
    """Key of the (stacked, layer-axis-first) ShardedTensor megatron-core writes for ``t``.

    megatron-core maps local-spec layernorm names to the TE names in ``sharded_state_dict``,
    so torch_dist keys are the same for both specs.
    """
    if t.layer is None:
        return t.name
    return f"{LAYER_PREFIX}{t.te_name or t.suffix}"
