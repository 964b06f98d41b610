"""Self-attention's logical tensors: megatron-core's ``SelfAttention`` (the fused group-major ``linear_qkv``, q/k
norms), ``MLASelfAttention`` (multi-latent attention's down- and up-projections), the learnable softmax offsets of
``DotProductAttention`` (attention sinks), and the output projection ``linear_proj`` with Megatron-Bridge's
sandwich post-norm. Suffixes after ``<stack>.layers.<N>.``; ``rules.py`` assembles them with the MLP's."""
from __future__ import annotations

from typing import TYPE_CHECKING

from .boxes import Kind
from .tensors import Cond, Rule, hidden, linear_bias

if TYPE_CHECKING:  # the layout reads a model config's attributes; it never imports the config's module
    from ..config import ModelConfig

_gqa: Cond = lambda c: not c.mla  # noqa: E731  (megatron-core SelfAttention: fused group-major linear_qkv)
_mla: Cond = lambda c: c.mla  # noqa: E731
_q_lora: Cond = lambda c: c.mla and c.mla.q_lora_rank is not None  # noqa: E731

GQA_RULES: tuple[Rule, ...] = (
    Rule("input_layernorm.weight", Kind.REP, hidden, _gqa, te_name="self_attention.linear_qkv.layer_norm_weight"),
    Rule("input_layernorm.bias", Kind.REP, hidden, lambda c: not c.mla and c.norm.bias,
         te_name="self_attention.linear_qkv.layer_norm_bias"),
    Rule("self_attention.linear_qkv.weight", Kind.COL, lambda c: (c.qkv_rows, c.hidden_size), _gqa),
    Rule("self_attention.linear_qkv.bias", Kind.COL, lambda c: (c.qkv_rows,), lambda c: not c.mla and c.add_qkv_bias),
    # per head (megatron-core's): one head's width, replicated; over all heads at once (OLMoE, MiniMax-M2; Megatron-
    # Bridge's full-width norm modules): the heads' width, split over TP with the heads
    *(Rule(f"self_attention.{n}_layernorm.{p}", kind, shape, lambda c, p=p, full=full: not c.mla and
           c.attention.qk_norm and c.attention.qk_norm_full == full and (p == "weight" or c.norm.bias))
      for full, n, kind, shape in (
          (False, "q", Kind.REP, lambda c: (c.kv_channels,)), (False, "k", Kind.REP, lambda c: (c.kv_channels,)),
          (True, "q", Kind.COL, lambda c: (c.num_attention_heads * c.kv_channels,)),
          (True, "k", Kind.COL, lambda c: (c.num_query_groups * c.kv_channels,)))
      for p in ("weight", "bias")),
)

# Multi-latent attention (megatron-core MLASelfAttention). The specs carry no key map: torch_dist keys follow each
# spec's own module names (see ``rules._layer_tensors``). The down-projections are split over TP in the local spec
# and replicated (TELinear "duplicated") in Transformer Engine's; see ``mla_down_kind``.
# Rows of linear_kv_down_proj are [compressed kv (kv_lora_rank) | k_pe (qk_pos_emb_head_dim)], of the
# up-projections per head [q_nope | q_pe] and [k_nope | v]: HF's order, no permutation.
MLA_RULES: tuple[Rule, ...] = (
    Rule("input_layernorm.weight", Kind.REP, hidden, _mla),
    Rule("input_layernorm.bias", Kind.REP, hidden, lambda c: c.mla and c.norm.bias),
    Rule("self_attention.linear_q_proj.weight", Kind.COL,
         lambda c: (c.num_attention_heads * c.mla.q_head_dim, c.hidden_size),
         lambda c: c.mla and c.mla.q_lora_rank is None),
    Rule("self_attention.linear_q_down_proj.weight", Kind.COL, lambda c: (c.mla.q_lora_rank, c.hidden_size), _q_lora),
    Rule("self_attention.q_layernorm.weight", Kind.REP, lambda c: (c.mla.q_lora_rank,),
         lambda c: c.mla and c.mla.q_lora_rank is not None and c.attention.qk_norm,
         te_name="self_attention.linear_q_up_proj.layer_norm_weight"),
    Rule("self_attention.linear_q_up_proj.weight", Kind.COL,
         lambda c: (c.num_attention_heads * c.mla.q_head_dim, c.mla.q_lora_rank), _q_lora),
    Rule("self_attention.linear_kv_down_proj.weight", Kind.COL,
         lambda c: (c.mla.kv_lora_rank + c.mla.qk_pos_emb_head_dim, c.hidden_size), _mla),
    Rule("self_attention.kv_layernorm.weight", Kind.REP, lambda c: (c.mla.kv_lora_rank,),
         lambda c: c.mla and c.attention.qk_norm, te_name="self_attention.linear_kv_up_proj.layer_norm_weight"),
    Rule("self_attention.linear_kv_up_proj.weight", Kind.COL,
         lambda c: (c.num_attention_heads * (c.mla.qk_head_dim + c.mla.v_head_dim), c.mla.kv_lora_rank), _mla),
)

# the attention's sinks, then its output projection (and the post-norm on it)
PROJ_RULES: tuple[Rule, ...] = (
    # attention sinks (megatron-core DotProductAttention with softmax_type "learnable"): one logit per head, split
    # over TP with the heads; the same name in Transformer Engine's attention
    Rule("self_attention.core_attention.softmax_offset", Kind.COL, lambda c: (c.num_attention_heads,),
         lambda c: not c.mla and c.attention.softmax_type == "learnable"),
    Rule("self_attention.linear_proj.weight", Kind.ROW, lambda c: (c.hidden_size, c.attn_proj_cols)),
    Rule("self_attention.linear_proj.bias", Kind.REP, hidden, linear_bias),
    # Gemma 2/3 sandwich norms: on the attention and MLP outputs (Megatron-Bridge's TERowParallelLinearLayerNorm)
    Rule("self_attention.linear_proj.post_layernorm.weight", Kind.REP, hidden, lambda c: c.norm.post_norms),
)

# a layer's attention tensors, in the order its logical tensors are listed: GQA's or MLA's, then the projection's
ATTENTION_RULES: tuple[Rule, ...] = GQA_RULES + MLA_RULES + PROJ_RULES


def mla_down_kind(rule: Rule, cfg: ModelConfig) -> Kind | None:
    """MLA's down-projections are replicated unless ``cfg.mla.down_split`` (local spec, older TE specs); None for
    every other rule."""
    if cfg.mla and (".linear_q_down_proj." in rule.name or ".linear_kv_down_proj." in rule.name):
        return Kind.COL if cfg.mla.down_split else Kind.REP
    return None


def mla_projections(cfg: ModelConfig) -> tuple[str, ...]:
    """The MLA projection modules with an ``_extra_state`` entry, in place of GQA's ``linear_qkv``."""
    assert cfg.mla is not None
    q = ("self_attention.linear_q_proj",) if cfg.mla.q_lora_rank is None else \
        ("self_attention.linear_q_down_proj", "self_attention.linear_q_up_proj")
    return (*q, "self_attention.linear_kv_down_proj", "self_attention.linear_kv_up_proj")
