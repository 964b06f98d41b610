"""The logical tensors of layers that are not attention: megatron-core's ``MambaMixer`` (Mamba2, the "M" layers of
``MambaModel``'s hybrid stack) and ``GatedDeltaNet`` (a GPTModel's ``experimental_attention_variant``
"gated_delta_net", among attention layers), suffixes after ``<stack>.layers.<N>.``; and the ``_extra_state`` modules
of a hybrid model's layers (Transformer Engine 2's, whatever the layer's kind)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from .attention import mla_projections
from .boxes import Kind
from .mlp import MLP_EXTRA_STATE, SHARED_EXPERT_MODULES
from .mtp import MTP_LAYER, MTP_TE2_MODULES
from .tensors import Rule, Sections, hidden

if TYPE_CHECKING:  # the layout reads a model config's attributes; it never imports the config's module
    from ..config import ModelConfig

_mamba_in: Sections = lambda c: c.mamba.sections  # noqa: E731  [z | x | B | C | dt]
_mamba_conv: Sections = lambda c: c.mamba.sections[1:4]  # noqa: E731  [x | B | C]
_gdn_in: Sections = lambda c: c.gdn.sections  # noqa: E731  [query | key | value | z | beta | alpha]
_gdn_conv: Sections = lambda c: c.gdn.sections[:3]  # noqa: E731  [query | key | value]


def _rows(sections: Sections, cfg: ModelConfig) -> int:
    return sum(n for _, n in sections(cfg))


MAMBA_CONV_KERNEL = 4  # megatron-core's MambaMixer d_conv (fixed by its layer spec)
# Mamba2 mixer layers of megatron-core's MambaModel ("M"): the pre-norm is fused into in_proj (Transformer Engine)
MAMBA_RULES: tuple[Rule, ...] = (
    Rule("input_layernorm.weight", Kind.REP, hidden, mixer="mamba", te_name="mixer.in_proj.layer_norm_weight"),
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
    Rule("input_layernorm.weight", Kind.REP, hidden, mixer="gdn", te_name="self_attention.in_proj.layer_norm_weight"),
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


def hybrid(cfg: ModelConfig) -> bool:
    """Layers of more than one kind: MambaModel's hybrid stack, or Gated DeltaNet among attention layers."""
    return cfg.mamba is not None or cfg.gdn is not None


# a GPT layer's modules that a HybridModel holds in its mixer layer (the rest: its MLP / MoE layer)
MIXER_PARTS = ("input_layernorm.", "self_attention.")
HYBRID_MTP_LAYERS = "mtp_model_layer.layers."  # a HybridModel MTP depth's layers (a HybridStack of its own)


def mtp_layer_prefix(cfg: ModelConfig, suffix: str) -> str:
    """Where an MTP layer's module ``suffix`` (a decoder layer's, e.g. ``self_attention.linear_proj.weight``) lives
    under ``mtp.layers.<K>.``: GPTModel's ``transformer_layer.``; a HybridModel's depth pattern (one mixer, one MLP
    layer) ``mtp_model_layer.layers.0.`` for the mixer's modules, ``.1.`` for the MLP's."""
    if cfg.mamba is None:
        return MTP_LAYER
    return f"{HYBRID_MTP_LAYERS}{0 if (suffix + '.').startswith(MIXER_PARTS) else 1}."


# a hybrid layer's modules with an ``_extra_state`` (Transformer Engine 2: its linears and norms, not its attention
# core), by the layer's mixer and MLP kind (see ``te2_layer_modules``)
MIXER_EXTRA_STATE = {"mamba": ("mixer.in_proj", "mixer.out_proj"),
                     "gdn": ("self_attention.in_proj", "self_attention.out_norm", "self_attention.out_proj"),
                     "attention": ("self_attention.linear_qkv", "self_attention.linear_proj"),
                     None: ()}


def te2_layer_modules(cfg: ModelConfig, stack: str, layer: int) -> tuple[str, ...]:
    """The ``_extra_state`` modules of a hybrid model's layer (always Transformer Engine's spec: MambaModel and the
    Gated DeltaNet spec have no other); an MoE layer's routed experts are ``expert_objects``'."""
    mixer, mlp = cfg.layer_kind(stack, layer)
    if mixer == "attention" and cfg.mla is not None:  # "+": its input norm a TENorm of its own, no fused linear_qkv
        out = ("input_layernorm", *mla_projections(cfg), "self_attention.linear_proj") + MLP_EXTRA_STATE[mlp]
    else:
        out = MIXER_EXTRA_STATE[mixer] + MLP_EXTRA_STATE[mlp]
    if mixer == "attention" and cfg.mla is None and cfg.attention.qk_norm and not cfg.attention.qk_norm_split:
        out += ("self_attention.q_layernorm", "self_attention.k_layernorm")
    if mlp == "moe" and cfg.shared_size:
        out += SHARED_EXPERT_MODULES
    if stack != "mtp":
        return out
    inner = tuple(mtp_layer_prefix(cfg, m) + m for m in out)
    return inner if cfg.mamba is None else MTP_TE2_MODULES + inner  # a HybridModel's: the MTP layer's own too
