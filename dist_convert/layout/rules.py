"""The layout table's assembly: a model's logical tensors and the names each format stores them under.

A logical tensor is one unsharded tensor in canonical megatron-core naming (local-spec module
names) with a global layer number, e.g. ``decoder.layers.17.self_attention.linear_qkv.weight``.
Each feature's rules live in a module of their own: self-attention (GQA, MLA, sinks, ``linear_proj``) in
``attention.py``, the dense MLP and MoE in ``mlp.py``, DeepSeek sparse attention in ``dsa.py``, multi-token
prediction in ``mtp.py``, Mamba2 and Gated DeltaNet in ``hybrid.py``, T5's cross-attention and top-level tensors in
``t5.py``, a vision component in ``vision.py``. Here: the order they are listed in, which layers have which, the
top-level tensors of a GPT / Mamba model, and the ``_extra_state`` modules and torch_dist keys of it all.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING

from .attention import ATTENTION_RULES, mla_down_kind, mla_projections
from .boxes import Kind
from .dsa import DSA_RULES, DSA_UNFUSED, dsa_layer_modules
from .hybrid import GDN_RULES, MAMBA_RULES, hybrid, mtp_layer_prefix, te2_layer_modules
from .mlp import MLP_PREFIXES, MLP_RULES, SHARED_EXPERT_MODULES, effective_kind
from .mtp import MTP_LAYER, MTP_RULES
from .t5 import CROSS_EXTRA_STATE_MODULES, CROSS_RULES, T5_TOP_RULES
from .tensors import LogicalTensor, Rule, hidden, norm_bias
from .topology import Layout
from .vision import vision_tensors

if TYPE_CHECKING:  # the layout reads a model config's attributes; it never imports the config's module
    from ..config import ModelConfig

# Per-layer tensors of a GPT layer, suffix after ``<stack>.layers.<N>.``: its attention's, then its MLP's
LAYER_RULES: tuple[Rule, ...] = ATTENTION_RULES + MLP_RULES

# Top-level tensors and where they live (see ``holders``): "first"/"last" pipeline stage (a T5 model's, with
# their further placements, are ``t5.T5_TOP_RULES``).
TOP_RULES: tuple[tuple[Rule, str], ...] = (
    (Rule("embedding.word_embeddings.weight", Kind.VOCAB, lambda c: (c.vocab_size, c.hidden_size)), "first"),
    (Rule("embedding.position_embeddings.weight", Kind.REP,
          lambda c: (c.max_position_embeddings or 0, c.hidden_size),
          lambda c: c.position.kind == "learned_absolute"), "first"),
    (Rule("decoder.final_layernorm.weight", Kind.REP, hidden, lambda c: c.mamba is None), "last"),
    (Rule("decoder.final_layernorm.bias", Kind.REP, hidden, norm_bias), "last"),
    (Rule("decoder.final_norm.weight", Kind.REP, hidden, lambda c: c.mamba is not None), "last"),  # MambaModel
    (Rule("output_layer.weight", Kind.VOCAB, lambda c: (c.vocab_size, c.hidden_size),
          lambda c: c.untie_embeddings_and_output_weights), "last"),
)

# Modules whose ``_extra_state`` megatron-core stores (None for the local spec, FP8 metadata for TE).
EXTRA_STATE_MODULES = {
    "local": ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"),
    "te": ("self_attention.linear_qkv", "self_attention.core_attention", "self_attention.linear_proj",
           "mlp.linear_fc1", "mlp.linear_fc2"),
}

# Megatron-Bridge's Gemma 2/3 spec (post_norms): Transformer Engine 2's norms keep an ``_extra_state`` too, and
# its attention saves none; the final norm's is a top-level entry (``top_extra_state_modules``)
POST_NORM_EXTRA_STATE_MODULES = (
    "self_attention.linear_qkv", "self_attention.q_layernorm", "self_attention.k_layernorm",
    "self_attention.linear_proj", "self_attention.linear_proj.post_layernorm", "mlp.linear_fc1", "mlp.linear_fc2",
    "mlp.linear_fc2.post_layernorm")


def top_extra_state_modules(cfg: ModelConfig) -> tuple[str, ...]:
    """Top-level modules (on the last stage) with an ``_extra_state`` entry in torch_dist: Transformer Engine 2's
    final norm (MambaModel's ``decoder.final_norm``; a GPT model's where a record says its spec is built from
    Transformer Engine 2's modules, ``Feature.te2_spec``: Megatron-Bridge's Gemma 3, Gated DeltaNet, DSA and
    vision-language models)."""
    if cfg.mamba is not None:
        return ("decoder.final_norm",)
    te2 = any(r.uses_te2_spec for r in cfg.records())
    return ("decoder.final_layernorm",) if te2 and cfg.spec == "te" else ()


# Output-layer modules with an ``_extra_state`` entry, and the names a PP>1 last stage stores a
# copy of the tied word embeddings under (legacy rank files).
OUTPUT_MODULES = {"gpt": ("output_layer",), "t5": ("lm_head.output_layer", "output_layer")}
TIED_COPIES = {"gpt": ("output_layer.weight",), "t5": ("lm_head.output_layer.weight", "output_layer.weight")}

EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"
LAYER_PREFIX = "decoder.layers."
_LAYER_RE = re.compile(r"^(?:encoder|decoder|mtp)\.layers\.(\d+)\.(.+)$")


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


def rule_kind(rule: Rule, cfg: ModelConfig) -> Kind:
    """How a layer rule's tensor splits in this model: MLA's down-projections by the spec (``mla_down_kind``),
    SwiGLU's fc1 halves each on its own (``effective_kind``), else the rule's kind."""
    down = mla_down_kind(rule, cfg)
    return down if down is not None else effective_kind(rule, cfg)


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
    kind, out = rule_kind(rule, cfg), []
    for e in range(cfg.num_experts) if rule.per_expert else [None]:
        suffix = inner + (rule.name.format(e=e) if e is not None else rule.name)
        full = f"{stack}.layers.{layer}.{suffix}"
        out.append(LogicalTensor(name=full, kind=kind, shape=rule.shape(cfg), layer=layer, suffix=suffix,
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
                    out.update((t.name, t) for t in _layer_tensors(
                        rule, cfg, name, layer, mtp_layer_prefix(cfg, rule.name) if name == "mtp" else ""))
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


def extra_state_modules(cfg: ModelConfig, stack: str, spec: str, layer: int | None = None) -> tuple[str, ...]:
    """Modules of a layer with an ``_extra_state`` entry. An MoE layer (``layer`` given) has no dense
    MLP but its shared experts' linears; its routed experts' entries are named by ``expert_modules``.
    An MTP layer has its eh_proj's and its TransformerLayer's (under ``transformer_layer.``)."""
    cross = CROSS_EXTRA_STATE_MODULES[spec] if cfg.t5 is not None and stack == "decoder" else ()
    if cfg.dsa is not None and layer is not None:
        return dsa_layer_modules(cfg, stack, layer)
    te2 = hybrid(cfg) or cfg.attention.qk_norm_full or (cfg.vision is not None and spec == "te"
                                                         and not cfg.norm.post_norms)
    if te2 and layer is not None:  # Megatron-Bridge's vision-language and full-width q/k norm models: TE 2's too
        return te2_layer_modules(cfg, stack, layer)
    base = EXTRA_STATE_MODULES[spec]
    if cfg.norm.post_norms and spec == "te":
        base = tuple(m for m in POST_NORM_EXTRA_STATE_MODULES if cfg.attention.qk_norm or "_layernorm" not in m)
    if cfg.mla:
        base = tuple(x for m in base for x in (mla_projections(cfg) if m == "self_attention.linear_qkv" else (m,)))
    if layer is not None and cfg.layer_is_moe(stack, layer):
        shared = SHARED_EXPERT_MODULES if cfg.shared_size else ()
        base = tuple(m for m in base if not m.startswith("mlp.")) + shared
    if stack == "mtp":
        return ("eh_proj",) + tuple(MTP_LAYER + m for m in base)
    return base + cross


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
