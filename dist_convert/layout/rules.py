"""The one declarative layout table of GPT checkpoints, and the names each format stores them under.

A logical tensor is one unsharded tensor in canonical megatron-core naming (local-spec module
names) with a global layer number, e.g. ``decoder.layers.17.self_attention.linear_qkv.weight``.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING

from .boxes import Kind
from .tensors import Cond, LogicalTensor, Rule, Shape
from .topology import Layout
from .vision import vision_tensors

if TYPE_CHECKING:  # the layout reads a model config's attributes; it never imports the config's module
    from ..config import ModelConfig

_norm_bias: Cond = lambda c: c.norm.bias  # noqa: E731
_bias: Cond = lambda c: c.add_bias_linear  # noqa: E731
_h: Shape = lambda c: (c.hidden_size,)  # noqa: E731
_gqa: Cond = lambda c: not c.mla  # noqa: E731  (megatron-core SelfAttention: fused group-major linear_qkv)
_mla: Cond = lambda c: c.mla  # noqa: E731
_q_lora: Cond = lambda c: c.mla and c.mla.q_lora_rank is not None  # noqa: E731


# Per-layer tensors: suffix after ``decoder.layers.<N>.``
LAYER_RULES: tuple[Rule, ...] = (
    Rule("input_layernorm.weight", Kind.REP, _h, _gqa, te_name="self_attention.linear_qkv.layer_norm_weight"),
    Rule("input_layernorm.bias", Kind.REP, _h, lambda c: not c.mla and c.norm.bias,
         te_name="self_attention.linear_qkv.layer_norm_bias"),
    Rule("self_attention.linear_qkv.weight", Kind.COL, lambda c: (c.qkv_rows, c.hidden_size), _gqa),
    Rule("self_attention.linear_qkv.bias", Kind.COL, lambda c: (c.qkv_rows,), lambda c: not c.mla and c.add_qkv_bias),
    Rule("self_attention.q_layernorm.weight", Kind.REP, lambda c: (c.kv_channels,),
         lambda c: not c.mla and c.attention.qk_norm),
    Rule("self_attention.q_layernorm.bias", Kind.REP, lambda c: (c.kv_channels,),
         lambda c: not c.mla and c.attention.qk_norm and c.norm.bias),
    Rule("self_attention.k_layernorm.weight", Kind.REP, lambda c: (c.kv_channels,),
         lambda c: not c.mla and c.attention.qk_norm),
    Rule("self_attention.k_layernorm.bias", Kind.REP, lambda c: (c.kv_channels,),
         lambda c: not c.mla and c.attention.qk_norm and c.norm.bias),
) + (
    # Multi-latent attention (megatron-core MLASelfAttention). The specs carry no key map: torch_dist keys
    # follow each spec's own module names (see ``_layer_tensors``). The down-projections are split over
    # TP in the local spec and replicated (TELinear "duplicated") in Transformer Engine's; see ``mla_kind``.
    # Rows of linear_kv_down_proj are [compressed kv (kv_lora_rank) | k_pe (qk_pos_emb_head_dim)], of the
    # up-projections per head [q_nope | q_pe] and [k_nope | v]: HF's order, no permutation.
    Rule("input_layernorm.weight", Kind.REP, _h, _mla),
    Rule("input_layernorm.bias", Kind.REP, _h, lambda c: c.mla and c.norm.bias),
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
) + (
    # attention sinks (megatron-core DotProductAttention with softmax_type "learnable"): one logit per head, split
    # over TP with the heads; the same name in Transformer Engine's attention
    Rule("self_attention.core_attention.softmax_offset", Kind.COL, lambda c: (c.num_attention_heads,),
         lambda c: not c.mla and c.attention.softmax_type == "learnable"),
    Rule("self_attention.linear_proj.weight", Kind.ROW, lambda c: (c.hidden_size, c.attn_proj_cols)),
    Rule("self_attention.linear_proj.bias", Kind.REP, _h, _bias),
    # Gemma 2/3 sandwich norms: on the attention and MLP outputs (Megatron-Bridge's TERowParallelLinearLayerNorm)
    Rule("self_attention.linear_proj.post_layernorm.weight", Kind.REP, _h, lambda c: c.norm.post_norms),
    Rule("pre_mlp_layernorm.weight", Kind.REP, _h, te_name="mlp.linear_fc1.layer_norm_weight"),
    Rule("pre_mlp_layernorm.bias", Kind.REP, _h, _norm_bias, te_name="mlp.linear_fc1.layer_norm_bias"),
    Rule("mlp.linear_fc1.weight", Kind.COL, lambda c: (c.fc1_rows, c.hidden_size), layers="dense"),
    Rule("mlp.linear_fc1.bias", Kind.COL, lambda c: (c.fc1_rows,), _bias, layers="dense"),
    Rule("mlp.linear_fc2.weight", Kind.ROW, lambda c: (c.hidden_size, c.ffn_hidden_size), layers="dense"),
    Rule("mlp.linear_fc2.bias", Kind.REP, _h, _bias, layers="dense"),
    Rule("mlp.linear_fc2.post_layernorm.weight", Kind.REP, _h, lambda c: c.norm.post_norms, layers="dense"),
) + (
    # MoE layers (megatron-core MoELayer): a replicated router, routed experts split over expert-TP
    # and spread over expert-parallel ranks (logical name: the global expert index), shared experts
    # split over TP. torch_dist stacks the experts of a layer on an axis after the layer axis.
    Rule("mlp.router.weight", Kind.REP, lambda c: (c.num_experts, c.hidden_size), layers="moe"),
    Rule("mlp.router.bias", Kind.REP, lambda c: (c.num_experts,), _bias, layers="moe"),
    Rule("mlp.router.expert_bias", Kind.REP, lambda c: (c.num_experts,),
         lambda c: c.moe is not None and c.moe.expert_bias, layers="moe"),
    Rule("mlp.experts.local_experts.{e}.linear_fc1.weight", Kind.COL, lambda c: (c.expert_fc1_rows, c.hidden_size),
         layers="moe", per_expert=True, dist_name="mlp.experts.experts.linear_fc1.weight"),
    Rule("mlp.experts.local_experts.{e}.linear_fc1.bias", Kind.COL, lambda c: (c.expert_fc1_rows,), _bias,
         layers="moe", per_expert=True, dist_name="mlp.experts.experts.linear_fc1.bias"),
    Rule("mlp.experts.local_experts.{e}.linear_fc2.weight", Kind.ROW, lambda c: (c.hidden_size, c.expert_ffn),
         layers="moe", per_expert=True, dist_name="mlp.experts.experts.linear_fc2.weight"),
    Rule("mlp.experts.local_experts.{e}.linear_fc2.bias", Kind.REP, _h, _bias, layers="moe", per_expert=True,
         dist_name="mlp.experts.experts.linear_fc2.bias"),
    Rule("mlp.shared_experts.linear_fc1.weight", Kind.COL, lambda c: (c.shared_fc1_rows, c.hidden_size),
         lambda c: bool(c.shared_size), layers="moe"),
    Rule("mlp.shared_experts.linear_fc2.weight", Kind.ROW,
         lambda c: (c.hidden_size, c.shared_size or 0),
         lambda c: bool(c.shared_size), layers="moe"),
    Rule("mlp.shared_experts.gate_weight", Kind.REP, lambda c: (1, c.hidden_size),
         lambda c: bool(c.shared_size) and c.moe.shared_gate, layers="moe"),
)

# DeepSeek sparse attention (megatron-core's DSA spec: AbsorbedMLASelfAttention over DSAttention): the lightning
# indexer of a layer that computes its top-k (``ModelConfig.has_indexer``), replicated over TP. The MLA tensors are
# LAYER_RULES', with the q/kv norms as modules of their own (``DSA_UNFUSED``: the indexer reads the normed q latent).
_ix: Shape = lambda c: (c.dsa.head_dim,)  # noqa: E731
INDEXER = "self_attention.core_attention.indexer."
DSA_RULES: tuple[Rule, ...] = (
    Rule(INDEXER + "linear_wq_b.weight", Kind.REP,
         lambda c: (c.dsa.n_heads * c.dsa.head_dim, c.mla.q_lora_rank or c.hidden_size), layers="indexed"),
    Rule(INDEXER + "linear_wk.weight", Kind.REP, lambda c: (c.dsa.head_dim, c.hidden_size), layers="indexed"),
    Rule(INDEXER + "k_norm.weight", Kind.REP, _ix, layers="indexed"),
    Rule(INDEXER + "k_norm.bias", Kind.REP, _ix, layers="indexed"),
    Rule(INDEXER + "linear_weights_proj.weight", Kind.REP, lambda c: (c.dsa.n_heads, c.hidden_size), layers="indexed"),
)
DSA_UNFUSED = frozenset({"self_attention.q_layernorm.weight", "self_attention.kv_layernorm.weight"})

# Multi-token-prediction layers (megatron-core MultiTokenPredictionLayer), suffix after ``mtp.layers.<K>.``;
# the layer's TransformerLayer follows under ``transformer_layer.`` (LAYER_RULES, built like the last
# decoder layer). eh_proj maps [enorm(embedding); hnorm(hidden)] (2h) to h, column-parallel.
MTP_RULES: tuple[Rule, ...] = (
    Rule("enorm.weight", Kind.REP, _h),
    Rule("hnorm.weight", Kind.REP, _h),
    Rule("eh_proj.weight", Kind.COL, lambda c: (c.hidden_size, 2 * c.hidden_size)),
    Rule("final_layernorm.weight", Kind.REP, _h),
)
MTP_LAYER = "transformer_layer."

Sections = Callable[["ModelConfig"], tuple[tuple[str, int], ...]]
_mamba_in: Sections = lambda c: c.mamba.sections  # noqa: E731  [z | x | B | C | dt]
_mamba_conv: Sections = lambda c: c.mamba.sections[1:4]  # noqa: E731  [x | B | C]
_gdn_in: Sections = lambda c: c.gdn.sections  # noqa: E731  [query | key | value | z | beta | alpha]
_gdn_conv: Sections = lambda c: c.gdn.sections[:3]  # noqa: E731  [query | key | value]


def _rows(sections: Sections, cfg: ModelConfig) -> int:
    return sum(n for _, n in sections(cfg))


MAMBA_CONV_KERNEL = 4  # megatron-core's MambaMixer d_conv (fixed by its layer spec)
# Mamba2 mixer layers of megatron-core's MambaModel ("M"): the pre-norm is fused into in_proj (Transformer Engine)
MAMBA_RULES: tuple[Rule, ...] = (
    Rule("input_layernorm.weight", Kind.REP, _h, mixer="mamba", te_name="mixer.in_proj.layer_norm_weight"),
    Rule("mixer.in_proj.weight", Kind.PARTS, lambda c: (_rows(_mamba_in, c), c.hidden_size), mixer="mamba",
         sections=_mamba_in, dist_split=True),
    Rule("mixer.conv1d.weight", Kind.PARTS, lambda c: (_rows(_mamba_conv, c), 1, MAMBA_CONV_KERNEL), mixer="mamba",
         sections=_mamba_conv, dist_split=True),
    Rule("mixer.conv1d.bias", Kind.PARTS, lambda c: (_rows(_mamba_conv, c),), mixer="mamba", sections=_mamba_conv,
         dist_split=True),
    Rule("mixer.dt_bias", Kind.COL, lambda c: (c.mamba.num_heads,), mixer="mamba"),
    Rule("mixer.A_log", Kind.COL, lambda c: (c.mamba.num_heads,), mixer="mamba"),
    Rule("mixer.D", Kind.COL, lambda c: (c.mamba.num_heads,), mixer="mamba"),
    Rule("mixer.norm.weight", Kind.COL, lambda c: (c.mamba.d_inner,), mixer="mamba"),
    Rule("mixer.out_proj.weight", Kind.ROW, lambda c: (c.hidden_size, c.mamba.d_inner), mixer="mamba"),
)
# Gated DeltaNet layers of a GPTModel (experimental_attention_variant "gated_delta_net"); the input norm is fused
# into in_proj, the output norm (over one value head) is replicated
GDN_RULES: tuple[Rule, ...] = (
    Rule("input_layernorm.weight", Kind.REP, _h, mixer="gdn", te_name="self_attention.in_proj.layer_norm_weight"),
    Rule("self_attention.in_proj.weight", Kind.PARTS, lambda c: (_rows(_gdn_in, c), c.hidden_size), mixer="gdn",
         sections=_gdn_in, dist_split=True),
    Rule("self_attention.conv1d.weight", Kind.PARTS, lambda c: (_rows(_gdn_conv, c), 1, c.gdn.conv_kernel_dim),
         mixer="gdn", sections=_gdn_conv, dist_split=True),
    Rule("self_attention.dt_bias", Kind.COL, lambda c: (c.gdn.num_value_heads,), mixer="gdn"),
    Rule("self_attention.A_log", Kind.COL, lambda c: (c.gdn.num_value_heads,), mixer="gdn"),
    Rule("self_attention.out_norm.weight", Kind.REP, lambda c: (c.gdn.value_head_dim,), mixer="gdn"),
    Rule("self_attention.out_proj.weight", Kind.ROW,
         lambda c: (c.hidden_size, c.gdn.num_value_heads * c.gdn.value_head_dim), mixer="gdn"),
)

# T5 decoder layers add cross-attention (linear_kv rows are group-major [k_g; v_g], so a dim-0 split is exact).
CROSS_RULES: tuple[Rule, ...] = (
    Rule("pre_cross_attn_layernorm.weight", Kind.REP, _h),
    Rule("pre_cross_attn_layernorm.bias", Kind.REP, _h, _norm_bias),
    Rule("cross_attention.linear_q.weight", Kind.COL, lambda c: (c.num_attention_heads * c.kv_channels, c.hidden_size)),
    Rule("cross_attention.linear_q.bias", Kind.COL, lambda c: (c.num_attention_heads * c.kv_channels,), _bias),
    Rule("cross_attention.linear_kv.weight", Kind.COL,
         lambda c: (2 * c.num_query_groups * c.kv_channels, c.hidden_size)),
    Rule("cross_attention.linear_kv.bias", Kind.COL, lambda c: (2 * c.num_query_groups * c.kv_channels,), _bias),
    Rule("cross_attention.linear_proj.weight", Kind.ROW,
         lambda c: (c.hidden_size, c.num_attention_heads * c.kv_channels)),
    Rule("cross_attention.linear_proj.bias", Kind.REP, _h, _bias),
)

# Top-level tensors and where they live (see ``holders``): "first"/"last" pipeline stage; for T5
# also "embed" (first stage and the first decoder stage), "encoder"/"decoder" (every stage of that
# stack), "encoder_last" (the last encoder stage).
TOP_RULES: tuple[tuple[Rule, str], ...] = (
    (Rule("embedding.word_embeddings.weight", Kind.VOCAB, lambda c: (c.vocab_size, c.hidden_size)), "first"),
    (Rule("embedding.position_embeddings.weight", Kind.REP,
          lambda c: (c.max_position_embeddings or 0, c.hidden_size),
          lambda c: c.position.kind == "learned_absolute"), "first"),
    (Rule("decoder.final_layernorm.weight", Kind.REP, _h, lambda c: c.mamba is None), "last"),
    (Rule("decoder.final_layernorm.bias", Kind.REP, _h, _norm_bias), "last"),
    (Rule("decoder.final_norm.weight", Kind.REP, _h, lambda c: c.mamba is not None), "last"),  # MambaModel
    (Rule("output_layer.weight", Kind.VOCAB, lambda c: (c.vocab_size, c.hidden_size),
          lambda c: c.untie_embeddings_and_output_weights), "last"),
)

_relative: Cond = lambda c: c.position.kind == "relative"  # noqa: E731
T5_TOP_RULES: tuple[tuple[Rule, str], ...] = (
    (Rule("embedding.word_embeddings.weight", Kind.VOCAB, lambda c: (c.vocab_size, c.hidden_size)), "embed"),
    (Rule("embedding.position_embeddings.weight", Kind.REP, lambda c: (c.max_position_embeddings or 0, c.hidden_size),
          lambda c: c.position.kind == "learned_absolute", aliases=("position_embeddings.weight",)), "embed"),
    (Rule("encoder_relative_pos_emb.relative_attention_bias.weight", Kind.REP,
          lambda c: (c.t5.relative_attention_num_buckets, c.num_attention_heads), _relative), "encoder"),
    (Rule("decoder_relative_pos_emb.relative_attention_bias.weight", Kind.REP,
          lambda c: (c.t5.relative_attention_num_buckets, c.num_attention_heads), _relative), "decoder"),
    (Rule("encoder.final_layernorm.weight", Kind.REP, _h), "encoder_last"),
    (Rule("encoder.final_layernorm.bias", Kind.REP, _h, _norm_bias), "encoder_last"),
    (Rule("decoder.final_layernorm.weight", Kind.REP, _h), "last"),
    (Rule("decoder.final_layernorm.bias", Kind.REP, _h, _norm_bias), "last"),
    (Rule("lm_head.output_layer.weight", Kind.VOCAB, lambda c: (c.vocab_size, c.hidden_size),
          lambda c: c.untie_embeddings_and_output_weights, aliases=("output_layer.weight",)), "last"),
    # with shared embeddings the T5 head has a (vocab-parallel) bias
    (Rule("lm_head.output_layer.bias", Kind.VOCAB, lambda c: (c.vocab_size,), lambda c: c.tied,
          aliases=("output_layer.bias",)), "last"),
)

# Modules whose ``_extra_state`` megatron-core stores (None for the local spec, FP8 metadata for TE).
EXTRA_STATE_MODULES = {
    "local": ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"),
    "te": ("self_attention.linear_qkv", "self_attention.core_attention", "self_attention.linear_proj",
           "mlp.linear_fc1", "mlp.linear_fc2"),
}

# Megatron-Bridge's Gemma 2/3 spec (post_norms): Transformer Engine 2's norms keep an ``_extra_state`` too, and
# its attention saves none; the final norm's is a top-level entry (TOP_EXTRA_STATE_MODULES)
POST_NORM_EXTRA_STATE_MODULES = (
    "self_attention.linear_qkv", "self_attention.q_layernorm", "self_attention.k_layernorm",
    "self_attention.linear_proj", "self_attention.linear_proj.post_layernorm", "mlp.linear_fc1", "mlp.linear_fc2",
    "mlp.linear_fc2.post_layernorm")


def top_extra_state_modules(cfg: ModelConfig) -> tuple[str, ...]:
    """Top-level modules (on the last stage) with an ``_extra_state`` entry in torch_dist: Transformer Engine 2's
    final norm (MambaModel's ``decoder.final_norm``; Megatron-Bridge's Gemma 3, Gated DeltaNet and vision-language
    models)."""
    if cfg.mamba is not None:
        return ("decoder.final_norm",)
    te2 = cfg.norm.post_norms or cfg.gdn is not None or cfg.vision is not None or cfg.dsa is not None
    return ("decoder.final_layernorm",) if te2 and cfg.spec == "te" else ()


CROSS_EXTRA_STATE_MODULES = {
    "local": ("cross_attention.linear_q", "cross_attention.linear_kv", "cross_attention.linear_proj"),
    "te": ("cross_attention.linear_q", "cross_attention.linear_kv", "cross_attention.core_attention",
           "cross_attention.linear_proj"),
}
# Output-layer modules with an ``_extra_state`` entry, and the names a PP>1 last stage stores a
# copy of the tied word embeddings under (legacy rank files).
OUTPUT_MODULES = {"gpt": ("output_layer",), "t5": ("lm_head.output_layer", "output_layer")}
TIED_COPIES = {"gpt": ("output_layer.weight",), "t5": ("lm_head.output_layer.weight", "output_layer.weight")}

EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"
LAYER_PREFIX = "decoder.layers."
_LAYER_RE = re.compile(r"^(?:encoder|decoder|mtp)\.layers\.(\d+)\.(.+)$")


def effective_kind(rule: Rule, cfg: ModelConfig) -> Kind:
    """SwiGLU fc1 (dense, routed and shared experts) is [gate; up]: each half splits on its own."""
    if rule.kind is Kind.COL and rule.name.startswith("mlp.") and ".linear_fc1." in rule.name and cfg.mlp.gated:
        return Kind.GLU
    return rule.kind


MLP_PREFIXES = ("mlp.", "pre_mlp_layernorm")


def _layer_rule_applies(rule: Rule, cfg: ModelConfig, stack: str, layer: int) -> bool:
    """Whether the layer has the rule's tensor: its mixer (attention, Mamba2, Gated DeltaNet) or its MLP (dense or
    MoE; a hybrid layer has one of the two) is the kind the rule belongs to."""
    if not rule.when(cfg):
        return False
    mixer, mlp = cfg.layer_kind(stack, layer)
    if rule.layers == "indexed":
        return mixer == "attention" and cfg.has_indexer(stack, layer)
    if rule.mixer is None and rule.name.startswith(MLP_PREFIXES):
        return mlp is not None and (rule.layers == "all" or (rule.layers == "moe") == (mlp == "moe"))
    return (rule.mixer or "attention") == mixer


def mla_kind(rule: Rule, cfg: ModelConfig) -> Kind:
    """MLA's down-projections are replicated unless ``cfg.mla.down_split`` (local spec, older TE specs)."""
    if cfg.mla and (".linear_q_down_proj." in rule.name or ".linear_kv_down_proj." in rule.name):
        return Kind.COL if cfg.mla.down_split else Kind.REP
    return effective_kind(rule, cfg)


def _layer_tensors(rule: Rule, cfg: ModelConfig, stack: str, layer: int, inner: str = "") -> list[LogicalTensor]:
    """The logical tensors of ``rule`` in one layer; ``inner`` prefixes the rule's name (an MTP layer's
    TransformerLayer lives under ``transformer_layer.``)."""
    te_name, dist = rule.te_name, rule.dist_name
    if cfg.dsa is not None and rule.name in DSA_UNFUSED:
        te_name = None
    if rule.name.startswith("pre_mlp_layernorm") and cfg.layer_is_moe(stack, layer):
        # TE fuses it into linear_fc1 only in dense layers (an MoE layer keeps a TENorm of its own);
        # the local spec still maps it to the fused name in sharded_state_dict
        te_name, dist = None, (None if cfg.spec == "te" else rule.te_name)
    if cfg.mla and rule.dist_name is None:  # no key map in the MLA specs: each spec keys its own modules
        dist = te_name if cfg.spec == "te" else rule.name
    te_name, dist = (inner + te_name if te_name else None), (inner + dist if dist else None)
    sections = rule.sections(cfg) if rule.sections else ()
    out = []
    for e in range(cfg.num_experts) if rule.per_expert else [None]:
        suffix = inner + (rule.name.format(e=e) if e is not None else rule.name)
        full = f"{stack}.layers.{layer}.{suffix}"
        out.append(LogicalTensor(name=full, kind=mla_kind(rule, cfg), shape=rule.shape(cfg), layer=layer, suffix=suffix,
                                 stage="layer", te_name=te_name, stack=stack, expert=e, dist_suffix=dist,
                                 sections=tuple(n for _, n in sections),
                                 section_names=tuple(name for name, _ in sections) if rule.dist_split else ()))
    return out


def _top(rule: Rule, stage: str, cfg: ModelConfig) -> LogicalTensor:
    return LogicalTensor(name=rule.name, kind=rule.kind, shape=rule.shape(cfg), layer=None, suffix=rule.name,
                         stage=stage, te_name=None, aliases=rule.aliases)


def logical_tensors(cfg: ModelConfig) -> dict[str, LogicalTensor]:
    """Every logical tensor of the model, in a stable order: a vision component's (``layout/vision.py``), then
    top-level tensors outside the stacks, then per stack its layers followed by its own top-level tensors (e.g. its
    final layernorm)."""
    tops = [(r, st) for r, st in (T5_TOP_RULES if cfg.t5 is not None else TOP_RULES) if r.when(cfg)]
    stacks = cfg.stacks
    out: dict[str, LogicalTensor] = vision_tensors(cfg)
    for rule, stage in tops:
        if not any(rule.name.startswith(f"{name}.") for name, _ in stacks):
            out[rule.name] = _top(rule, stage, cfg)
    for name, count in stacks:
        rules = LAYER_RULES + (CROSS_RULES if cfg.t5 is not None and name == "decoder" else ()) \
            + (MAMBA_RULES if cfg.mamba is not None else ()) \
            + (GDN_RULES if cfg.gdn is not None else ()) + (DSA_RULES if cfg.dsa is not None else ())
        for layer in range(count):
            if name == "mtp":
                for rule in MTP_RULES:
                    out.update((t.name, t) for t in _layer_tensors(rule, cfg, name, layer))
            for rule in rules:
                if _layer_rule_applies(rule, cfg, name, layer):
                    out.update((t.name, t) for t in _layer_tensors(rule, cfg, name, layer,
                                                                   MTP_LAYER if name == "mtp" else ""))
        for rule, stage in tops:
            if rule.name.startswith(f"{name}."):
                out[rule.name] = _top(rule, stage, cfg)
    return out


def holders(stage: str, layout: Layout) -> list[tuple[int, int]]:
    """(pp rank, virtual stage) of every model chunk storing a top-level tensor; the first is its home."""
    pp, split = layout.pp, layout.split
    if stage == "first" or pp == 1:
        return [(0, 0)]
    if stage == "last":
        return [(pp - 1, layout.chunks_per_rank - 1)]
    assert split is not None, "encoder-decoder placements need a split rank with PP > 1"
    ranks = {"embed": [0, split], "encoder": range(split), "decoder": range(split, pp),
             "encoder_last": [split - 1]}[stage]
    return [(p, 0) for p in ranks]


def hybrid(cfg: ModelConfig) -> bool:
    """Layers of more than one kind: MambaModel's hybrid stack, or Gated DeltaNet among attention layers."""
    return cfg.mamba is not None or cfg.gdn is not None


# a hybrid layer's modules with an ``_extra_state`` (Transformer Engine 2: its linears and norms, not its attention
# core), by the layer's mixer and MLP kind (see ``te2_layer_modules``)
MIXER_EXTRA_STATE = {"mamba": ("mixer.in_proj", "mixer.out_proj"),
                     "gdn": ("self_attention.in_proj", "self_attention.out_norm", "self_attention.out_proj"),
                     "attention": ("self_attention.linear_qkv", "self_attention.linear_proj"),
                     None: ()}
MLP_EXTRA_STATE = {"dense": ("mlp.linear_fc1", "mlp.linear_fc2"), "moe": ("pre_mlp_layernorm",), None: ()}


def te2_layer_modules(cfg: ModelConfig, stack: str, layer: int) -> tuple[str, ...]:
    """The ``_extra_state`` modules of a hybrid model's layer (always Transformer Engine's spec: MambaModel and the
    Gated DeltaNet spec have no other); an MoE layer's routed experts are ``expert_objects``'."""
    mixer, mlp = cfg.layer_kind(stack, layer)
    out = MIXER_EXTRA_STATE[mixer] + MLP_EXTRA_STATE[mlp]
    if mixer == "attention" and cfg.attention.qk_norm:
        out += ("self_attention.q_layernorm", "self_attention.k_layernorm")
    if mlp == "moe" and cfg.shared_size:
        out += ("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2")
    return tuple(MTP_LAYER + m for m in out) if stack == "mtp" else out


MTP_TE2_MODULES = ("enorm", "hnorm", "eh_proj", "final_layernorm")  # an MTP layer's own Transformer Engine 2 modules


def dsa_layer_modules(cfg: ModelConfig, stack: str, layer: int) -> tuple[str, ...]:
    """The ``_extra_state`` modules of a layer of megatron-core's DSA spec (Transformer Engine 2's linears and norms;
    the DSAttention core has none); an MTP layer adds its own norms and eh_proj."""
    mla = cfg.mla
    assert mla is not None
    norm = cfg.attention.qk_norm
    q = ("linear_q_proj",) if mla.q_lora_rank is None else \
        ("linear_q_down_proj", *(("q_layernorm",) if norm else ()), "linear_q_up_proj")
    attn = (*q, "linear_kv_down_proj", *(("kv_layernorm",) if norm else ()), "linear_kv_up_proj", "linear_proj")
    indexer = tuple(INDEXER + m for m in ("linear_wq_b", "linear_wk", "k_norm", "linear_weights_proj")) \
        if cfg.has_indexer(stack, layer) else ()
    _, mlp = cfg.layer_kind(stack, layer)
    out = ("input_layernorm", *("self_attention." + m for m in attn), *indexer) + MLP_EXTRA_STATE[mlp]
    if mlp == "moe" and cfg.shared_size:
        out += ("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2")
    return MTP_TE2_MODULES + tuple(MTP_LAYER + m for m in out) if stack == "mtp" else out


def extra_state_modules(cfg: ModelConfig, stack: str, spec: str, layer: int | None = None) -> tuple[str, ...]:
    """Modules of a layer with an ``_extra_state`` entry. An MoE layer (``layer`` given) has no dense
    MLP but its shared experts' linears; its routed experts' entries are named by ``expert_modules``.
    An MTP layer has its eh_proj's and its TransformerLayer's (under ``transformer_layer.``)."""
    cross = CROSS_EXTRA_STATE_MODULES[spec] if cfg.t5 is not None and stack == "decoder" else ()
    if cfg.dsa is not None and layer is not None:
        return dsa_layer_modules(cfg, stack, layer)
    if (hybrid(cfg) or (cfg.vision is not None and not cfg.norm.post_norms)) and layer is not None:
        return te2_layer_modules(cfg, stack, layer)  # Megatron-Bridge's vision-language models: TE 2's modules too
    base = EXTRA_STATE_MODULES[spec]
    if cfg.norm.post_norms and spec == "te":
        base = tuple(m for m in POST_NORM_EXTRA_STATE_MODULES if cfg.attention.qk_norm or "_layernorm" not in m)
    if cfg.mla:
        q = ("self_attention.linear_q_proj",) if cfg.mla.q_lora_rank is None else \
            ("self_attention.linear_q_down_proj", "self_attention.linear_q_up_proj")
        base = tuple(x for m in base for x in ((*q, "self_attention.linear_kv_down_proj",
                                                "self_attention.linear_kv_up_proj")
                                               if m == "self_attention.linear_qkv" else (m,)))
    if layer is not None and cfg.layer_is_moe(stack, layer):
        shared = ("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2") \
            if cfg.shared_size else ()
        base = tuple(m for m in base if not m.startswith("mlp.")) + shared
    if stack == "mtp":
        return ("eh_proj",) + tuple(MTP_LAYER + m for m in base)
    return base + cross


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


def split_layer_name(name: str) -> tuple[int, str] | None:
    m = _LAYER_RE.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


def spec_suffix(t: LogicalTensor, spec: str) -> str:
    return t.te_name if (spec == "te" and t.te_name) else t.suffix


def torch_dist_key(t: LogicalTensor, per_layer: bool = False) -> str:  # per_layer: see ``stacked_layers``
    """Key of the ShardedTensor megatron-core writes for ``t``: stacked (one key per module, a
    leading global layer axis) or, with ``per_layer`` (see ``per_layer_keys``), one key per layer.

    megatron-core maps local-spec layernorm names to the TE names in ``sharded_state_dict``,
    so torch_dist keys are the same for both specs.
    """
    if t.layer is None:
        return t.name
    suffix = t.dist_suffix or t.te_name or t.suffix
    return f"{t.layer_prefix}{t.layer}.{suffix}" if per_layer else f"{t.layer_prefix}{suffix}"


def per_layer_keys(cfg: ModelConfig) -> bool:
    """megatron-core (TransformerBlock.sharded_state_dict) keys every decoder layer on its own, without
    a layer axis, when ``moe_layer_freq`` is a list or an int > 1 (``moe_layer_pattern`` set), or the layers are of
    more than one kind (Gated DeltaNet and attention: ``linear_attention_freq``); MambaModel's stack always does.
    MTP layers are always keyed on their own (MultiTokenPredictionBlock.sharded_state_dict)."""
    mixed = cfg.gdn is not None and len(set(cfg.gdn.pattern)) > 1
    return (bool(cfg.num_experts) and cfg.moe.layer_pattern is not None) or cfg.mamba is not None or mixed



def model_family(keys: list[str] | set[str]) -> str:
    """"t5" when the stored keys (megatron-core naming, no prefix) include an encoder stack, else "gpt"."""
    return "t5" if any(k.startswith("encoder.layers.") for k in keys) else "gpt"
