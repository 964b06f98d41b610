"""The MLP's logical tensors: megatron-core's dense ``MLP`` (with its pre-norm, fused into ``linear_fc1`` in
Transformer Engine's spec) and ``MoELayer`` (``TopKRouter``, routed experts as ``SequentialMLP`` / ``TEGroupedMLP``,
``SharedExpertMLP``); suffixes after ``<stack>.layers.<N>.``. Also the names a legacy checkpoint stores routed
experts under (their local index on an expert-parallel rank)."""
from __future__ import annotations

import re
from typing import TYPE_CHECKING

from .boxes import Kind
from .tensors import Rule, hidden, linear_bias, norm_bias

if TYPE_CHECKING:  # the layout reads a model config's attributes; it never imports the config's module
    from ..config import ModelConfig

MLP_PREFIXES = ("mlp.", "pre_mlp_layernorm")  # a rule of the MLP (dense or MoE) by its name

DENSE_RULES: tuple[Rule, ...] = (
    Rule("pre_mlp_layernorm.weight", Kind.REP, hidden, te_name="mlp.linear_fc1.layer_norm_weight"),
    Rule("pre_mlp_layernorm.bias", Kind.REP, hidden, norm_bias, te_name="mlp.linear_fc1.layer_norm_bias"),
    Rule("mlp.linear_fc1.weight", Kind.COL, lambda c: (c.fc1_rows, c.hidden_size), layers="dense"),
    Rule("mlp.linear_fc1.bias", Kind.COL, lambda c: (c.fc1_rows,), linear_bias, layers="dense"),
    Rule("mlp.linear_fc2.weight", Kind.ROW, lambda c: (c.hidden_size, c.ffn_hidden_size), layers="dense"),
    Rule("mlp.linear_fc2.bias", Kind.REP, hidden, linear_bias, layers="dense"),
    # Gemma 2/3 sandwich norm on the MLP output (Megatron-Bridge's TERowParallelLinearLayerNorm)
    Rule("mlp.linear_fc2.post_layernorm.weight", Kind.REP, hidden, lambda c: c.norm.post_norms, layers="dense"),
)

# MoE layers (megatron-core MoELayer): a replicated router, routed experts split over expert-TP
# and spread over expert-parallel ranks (logical name: the global expert index), shared experts
# split over TP. torch_dist stacks the experts of a layer on an axis after the layer axis.
MOE_RULES: tuple[Rule, ...] = (
    Rule("mlp.router.weight", Kind.REP, lambda c: (c.num_experts, c.hidden_size), layers="moe"),
    Rule("mlp.router.bias", Kind.REP, lambda c: (c.num_experts,), linear_bias, layers="moe"),
    Rule("mlp.router.expert_bias", Kind.REP, lambda c: (c.num_experts,),
         lambda c: c.moe is not None and c.moe.expert_bias, layers="moe"),
    Rule("mlp.experts.local_experts.{e}.linear_fc1.weight", Kind.COL, lambda c: (c.expert_fc1_rows, c.hidden_size),
         layers="moe", per_expert=True, dist_name="mlp.experts.experts.linear_fc1.weight"),
    Rule("mlp.experts.local_experts.{e}.linear_fc1.bias", Kind.COL, lambda c: (c.expert_fc1_rows,), linear_bias,
         layers="moe", per_expert=True, dist_name="mlp.experts.experts.linear_fc1.bias"),
    Rule("mlp.experts.local_experts.{e}.linear_fc2.weight", Kind.ROW, lambda c: (c.hidden_size, c.expert_ffn),
         layers="moe", per_expert=True, dist_name="mlp.experts.experts.linear_fc2.weight"),
    Rule("mlp.experts.local_experts.{e}.linear_fc2.bias", Kind.REP, hidden, linear_bias, layers="moe",
         per_expert=True, dist_name="mlp.experts.experts.linear_fc2.bias"),
    Rule("mlp.shared_experts.linear_fc1.weight", Kind.COL, lambda c: (c.shared_fc1_rows, c.hidden_size),
         lambda c: bool(c.shared_size), layers="moe"),
    Rule("mlp.shared_experts.linear_fc2.weight", Kind.ROW,
         lambda c: (c.hidden_size, c.shared_size or 0),
         lambda c: bool(c.shared_size), layers="moe"),
    Rule("mlp.shared_experts.gate_weight", Kind.REP, lambda c: (1, c.hidden_size),
         lambda c: bool(c.shared_size) and c.moe.shared_gate, layers="moe"),
)

# a layer's MLP tensors, in the order its logical tensors are listed: the dense MLP's, then an MoE layer's
MLP_RULES: tuple[Rule, ...] = DENSE_RULES + MOE_RULES

# Transformer Engine 2's MLP modules with an ``_extra_state`` entry, by the layer's MLP kind (an MoE layer's
# pre-norm is a TENorm of its own; its shared experts' linears are ``SHARED_EXPERT_MODULES``)
MLP_EXTRA_STATE = {"dense": ("mlp.linear_fc1", "mlp.linear_fc2"), "moe": ("pre_mlp_layernorm",), None: ()}
SHARED_EXPERT_MODULES = ("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2")


def effective_kind(rule: Rule, cfg: ModelConfig) -> Kind:
    """SwiGLU fc1 (dense, routed and shared experts) is [gate; up]: each half splits on its own."""
    if rule.kind is Kind.COL and rule.name.startswith("mlp.") and ".linear_fc1." in rule.name and cfg.mlp.gated:
        return Kind.GLU
    return rule.kind


def expert_modules(cfg: ModelConfig, local_experts: int) -> tuple[str, ...]:
    """Legacy ``state_dict`` modules of an MoE layer's routed experts with an ``_extra_state``:
    SequentialMLP has one per local expert and linear, TEGroupedMLP one per grouped linear."""
    if cfg.grouped_experts:
        return ("mlp.experts.linear_fc1", "mlp.experts.linear_fc2")
    return tuple(f"mlp.experts.local_experts.{i}.linear_fc{j}" for i in range(local_experts) for j in (1, 2))


_EXPERT_RE = re.compile(r"^(.*)mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)$")
_GROUPED_RE = re.compile(r"\.mlp\.experts\.linear_fc[12]\.(weight|bias)\d+$")


def expert_key(suffix: str, local: int, grouped: bool) -> str:
    """Legacy key suffix of a routed expert's tensor under its local index: SequentialMLP's
    ``mlp.experts.local_experts.{i}.linear_fc1.weight`` or TEGroupedMLP's ``mlp.experts.linear_fc1.weight{i}``
    (an MTP layer's under its ``transformer_layer.``)."""
    m = _EXPERT_RE.match(suffix)
    assert m, suffix
    inner, fc, param = m.group(1), m.group(3), m.group(4)
    return f"{inner}mlp.experts.{fc}.{param}{local}" if grouped else \
        f"{inner}mlp.experts.local_experts.{local}.{fc}.{param}"


def is_grouped_expert_key(key: str) -> bool:
    """Whether a legacy state-dict key is a TEGroupedMLP expert weight (``...mlp.experts.linear_fc1.weight3``)."""
    return bool(_GROUPED_RE.search(key))
