"""The vision component's logical tensors, as Megatron-Bridge's vision-language models hold them beside the language
model (``language_model.`` in a torch_dist checkpoint; its logical names stay the plain GPT ones, ``LM_PREFIX`` is
added to its keys). Each tower's record type (``features.vision.TOWERS``) has its own table (``TOWER_LAYOUTS``:
its tensors, its megatron-core objects, its stacks):

* ``Qwen3VLTower``: Bridge's Megatron-native Qwen3-VL tower (``Qwen3VLVisionModel``) under ``vision_model.``;
* ``Qwen25VLTower``: transformers' Qwen2.5-VL vision transformer, which Bridge keeps whole and replicated under
  ``visual.`` with Hugging Face's own module names (``QWEN2_5_VL``);
* ``Glm4vTower``: transformers' GLM-4V vision transformer (GLM-4.5V), kept the same way under ``visual.``
  (``GLM4V``);
* ``PixtralTower``: Mistral 3's Pixtral encoder and multimodal projector, kept the same way under ``vision_tower.``
  and ``multi_modal_projector.`` (``PIXTRAL``);
* ``SiglipTower``: Gemma 3's SigLIP encoder, kept the same way under ``vision_tower.``, and Bridge's multimodal
  projector (``multi_modal_projector.``: a replicated RMSNorm and a column-parallel projection; ``SIGLIP``);
* ``MoonViTTower``: Kimi-K2.5's MoonViT and patch-merger projector, kept the same way under ``vision_tower.`` and
  ``mm_projector.`` with the release's names (``MOONVIT``).

The Qwen3-VL tower is Megatron-native and always Transformer Engine's spec: pre-norms (LayerNorm, with bias) fused into
``linear_qkv`` / ``linear_fc1``, biases everywhere, a non-gated MLP, multi-head attention whose ``linear_qkv`` holds
each head's q, k, v rows in turn (megatron-core's group-major order with groups == heads). It splits over TP like a
language layer (column-parallel qkv / fc1, row-parallel proj / fc2); the Conv3d patch embedding and the learned
position embeddings are replicated; the patch mergers (the final one, on the hidden size, and one per deepstack
layer, on the merged width) are a LayerNorm, a column-parallel fc1 and a row-parallel fc2. The whole tower sits on
the first pipeline stage (``stage="first"``); its layers are one stack of their own (``VISION_STACK``), stacked on
a layer axis in torch_dist as megatron-core's TransformerBlock does.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ..features.vision import (
    TOWERS,
    Glm4vTower,
    MoonViTTower,
    PixtralTower,
    Qwen3VLTower,
    Qwen25VLTower,
    SiglipTower,
    Vision,
)
from .boxes import Kind
from .tensors import LogicalTensor, Rule, Shape

if TYPE_CHECKING:  # the layout reads a model config's attributes; it never imports the config's module
    from ..config import ModelConfig

VISION = "vision_model."
PROJECTOR = "multi_modal_projector."
# the torch_dist key prefixes of a vision component (every other key is the language model's, under LM_PREFIX)
COMPONENT_PREFIXES = (VISION, "visual.", "vision_tower.", PROJECTOR, "mm_projector.")
VISION_STACK = "vision_model.decoder"
DEEPSTACK_STACK = "vision_model.decoder.deepstack_merger_list"  # a ModuleList megatron-core stacks like layers
VISION_STACKS = (VISION_STACK, DEEPSTACK_STACK)  # stacked on a layer axis whatever the language model's keys do
LM_PREFIX = "language_model."
DEEPSTACK = DEEPSTACK_STACK + ".{j}."
MERGER = "vision_model.merger."


class TowerLayout(Protocol):
    """How a tower's record lays out beside the language model."""

    def tensors(self, cfg: ModelConfig) -> list[LogicalTensor]:
        """Its logical tensors, in the tower's order."""

    def objects(self, cfg: ModelConfig) -> dict[str, list]:
        """The ShardedObjects (``_extra_state``) megatron-core saves for it (first stage, rank 0)."""

    def stacks(self, cfg: ModelConfig) -> dict[str, int]:
        """Layers per stack of its own (stacked on a layer axis in torch_dist)."""


def vision_tensors(cfg: ModelConfig) -> dict[str, LogicalTensor]:
    """Every logical tensor of the model's vision component (none without one), in the tower's order."""
    return {} if cfg.vision is None else {t.name: t for t in tower_layout(cfg.vision).tensors(cfg)}


def stack_sizes(cfg: ModelConfig) -> dict[str, int]:
    """Layers per stack, the vision tower's (its layers, its deepstack mergers) included."""
    return dict(cfg.stacks) | ({} if cfg.vision is None else tower_layout(cfg.vision).stacks(cfg))


def vision_objects(cfg: ModelConfig) -> dict[str, list]:
    """The ShardedObjects (``_extra_state``) megatron-core saves for the vision component (first stage, rank 0):
    Transformer Engine's modules', none of a Hugging Face module's."""
    return {} if cfg.vision is None else tower_layout(cfg.vision).objects(cfg)


def key_prefix(cfg: ModelConfig, name: str) -> str:
    """What a torch_dist key of logical tensor ``name`` starts with beyond it: the language model's prefix in a
    multimodal model (the vision component's names carry their own)."""
    return LM_PREFIX if cfg.vision is not None and not name.startswith(COMPONENT_PREFIXES) else ""


def _top(rule: Rule, cfg: ModelConfig, prefix: str = "") -> LogicalTensor:
    name = prefix + rule.name
    return LogicalTensor(name=name, kind=rule.kind, shape=rule.shape(cfg), layer=None, suffix=name, stage="first",
                         te_name=None)


# -- Qwen3-VL: Megatron-native, split over TP --------------------------------------------------------------------
_vh: Shape = lambda c: (c.vision.hidden,)  # noqa: E731
_ffn: Shape = lambda c: (c.vision.ffn,)  # noqa: E731
_merged: Shape = lambda c: (c.vision.merged,)  # noqa: E731

# per layer, after ``vision_model.decoder.layers.N.``
LAYER_RULES: tuple[Rule, ...] = (
    Rule("self_attention.linear_qkv.layer_norm_weight", Kind.REP, _vh),
    Rule("self_attention.linear_qkv.layer_norm_bias", Kind.REP, _vh),
    Rule("self_attention.linear_qkv.weight", Kind.COL, lambda c: (3 * c.vision.hidden, c.vision.hidden)),
    Rule("self_attention.linear_qkv.bias", Kind.COL, lambda c: (3 * c.vision.hidden,)),
    Rule("self_attention.linear_proj.weight", Kind.ROW, lambda c: (c.vision.hidden, c.vision.hidden)),
    Rule("self_attention.linear_proj.bias", Kind.REP, _vh),
    Rule("mlp.linear_fc1.layer_norm_weight", Kind.REP, _vh),
    Rule("mlp.linear_fc1.layer_norm_bias", Kind.REP, _vh),
    Rule("mlp.linear_fc1.weight", Kind.COL, lambda c: (c.vision.ffn, c.vision.hidden)),
    Rule("mlp.linear_fc1.bias", Kind.COL, _ffn),
    Rule("mlp.linear_fc2.weight", Kind.ROW, lambda c: (c.vision.hidden, c.vision.ffn)),
    Rule("mlp.linear_fc2.bias", Kind.REP, _vh),
)
# a patch merger, after its prefix; ``norm``: the width its LayerNorm works on (the final merger normalises each
# patch before merging, a deepstack merger the merged token)
def merger_rules(norm: Shape) -> tuple[Rule, ...]:
    return (Rule("patch_norm.weight", Kind.REP, norm), Rule("patch_norm.bias", Kind.REP, norm),
            Rule("linear_fc1.weight", Kind.COL, lambda c: (c.vision.merged, c.vision.merged)),
            Rule("linear_fc1.bias", Kind.COL, _merged),
            Rule("linear_fc2.weight", Kind.ROW, lambda c: (c.vision.out_hidden, c.vision.merged)),
            Rule("linear_fc2.bias", Kind.REP, lambda c: (c.vision.out_hidden,)))


TOP_RULES: tuple[Rule, ...] = (
    Rule("vision_model.patch_embed.proj.weight", Kind.REP,
         lambda c: (c.vision.hidden, c.vision.in_channels, c.vision.temporal_patch, c.vision.patch, c.vision.patch)),
    Rule("vision_model.patch_embed.proj.bias", Kind.REP, _vh),
    Rule("vision_model.pos_embed.weight", Kind.REP, lambda c: (c.vision.positions, c.vision.hidden)),
)
# modules of the tower with an ``_extra_state`` (Transformer Engine 2's linears and norms; its attention saves none)
LAYER_EXTRA_STATE = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
MERGER_EXTRA_STATE = ("patch_norm", "linear_fc1", "linear_fc2")


class MegatronQwen3VL:
    """Bridge's ``Qwen3VLVisionModel``: the patch and position embeddings, the layers (a stack), the final merger and
    the deepstack mergers (a stack of their own)."""

    def tensors(self, cfg: ModelConfig) -> list[LogicalTensor]:
        v = cfg.vision
        out = [_top(r, cfg) for r in TOP_RULES]
        for layer in range(v.depth):
            out += [LogicalTensor(name=f"{VISION_STACK}.layers.{layer}.{r.name}", kind=r.kind, shape=r.shape(cfg),
                                  layer=layer, suffix=r.name, stage="first", te_name=None, stack=VISION_STACK)
                    for r in LAYER_RULES]
        out += [_top(r, cfg, MERGER) for r in merger_rules(_vh)]
        for j in range(len(v.deepstack)):
            out += [LogicalTensor(name=DEEPSTACK.format(j=j) + r.name, kind=r.kind, shape=r.shape(cfg), layer=j,
                                  suffix=r.name, stage="first", te_name=None, stack=DEEPSTACK_STACK, items="")
                    for r in merger_rules(_merged)]
        return out

    def objects(self, cfg: ModelConfig) -> dict[str, list]:
        v = cfg.vision
        out = {f"{VISION_STACK}.layers.{m}._extra_state/shard_{i}_{v.depth}": [None]
               for i in range(v.depth) for m in LAYER_EXTRA_STATE}
        n = len(v.deepstack)
        out.update({f"{DEEPSTACK_STACK}.{m}._extra_state/shard_{j}_{n}": [None]
                    for j in range(n) for m in MERGER_EXTRA_STATE})
        out.update({f"{MERGER}{m}._extra_state/shard_0_1": [None] for m in MERGER_EXTRA_STATE})
        return out

    def stacks(self, cfg: ModelConfig) -> dict[str, int]:
        return {VISION_STACK: cfg.vision.depth, DEEPSTACK_STACK: len(cfg.vision.deepstack)}


# -- the towers Bridge keeps as Hugging Face modules: (their suffix, shape), in the module's order ---------------
Table = list[tuple[str, tuple[int, ...]]]


@dataclass(frozen=True)
class HFModule:
    """A tower Bridge keeps whole as a Hugging Face module, replicated, under ``prefix`` with the module's own names
    (``table``), and Bridge's projector beside it (``projector``: rules of full names)."""

    prefix: str
    table: Callable[[ModelConfig], Table]
    projector: tuple[Rule, ...] = ()

    def names(self, cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
        """The module's tensors: (full name, shape), in its order."""
        return [(self.prefix + suffix, shape) for suffix, shape in self.table(cfg)]

    def tensors(self, cfg: ModelConfig) -> list[LogicalTensor]:
        return [LogicalTensor(name=name, kind=Kind.REP, shape=shape, layer=None, suffix=name, stage="first",
                              te_name=None) for name, shape in self.names(cfg)] + [_top(r, cfg) for r in self.projector]

    def objects(self, cfg: ModelConfig) -> dict[str, list]:
        return {f"{r.name.removesuffix('.weight')}._extra_state/shard_0_1": [None] for r in self.projector}

    def stacks(self, cfg: ModelConfig) -> dict[str, int]:
        return {}


def _linear(name: str, rows: int, cols: int) -> Table:
    return [(f"{name}.weight", (rows, cols)), (f"{name}.bias", (rows,))]


def _norm(name: str, n: int) -> Table:
    return [(f"{name}.weight", (n,)), (f"{name}.bias", (n,))]


def qwen2_5_vl_tower(cfg: ModelConfig) -> Table:
    """transformers' ``Qwen2_5_VisionTransformerPretrainedModel``: RMSNorm pre-norms, a fused q/k/v with bias, a gated
    MLP with biases, the merger's RMSNorm and two-layer MLP on the merged width."""
    v = cfg.vision
    h, m = v.hidden, v.merged
    out: Table = [("patch_embed.proj.weight", (h, v.in_channels, v.temporal_patch, v.patch, v.patch))]
    for i in range(v.depth):
        b = f"blocks.{i}."
        out += [(b + "norm1.weight", (h,)), (b + "norm2.weight", (h,)), *_linear(b + "attn.qkv", 3 * h, h),
                *_linear(b + "attn.proj", h, h), *_linear(b + "mlp.gate_proj", v.ffn, h),
                *_linear(b + "mlp.up_proj", v.ffn, h), *_linear(b + "mlp.down_proj", h, v.ffn)]
    return out + [("merger.ln_q.weight", (h,)), *_linear("merger.mlp.0", m, m),
                  *_linear("merger.mlp.2", v.out_hidden, m)]


def siglip_tower(cfg: ModelConfig) -> Table:
    """transformers' SigLIP vision encoder (``SiglipVisionModel`` flattened, as Gemma 3 holds it): LayerNorms with
    biases, separate q/k/v, a GELU MLP, the post-norm, and the attention-pooling head when the config keeps it."""
    v = cfg.vision
    h = v.hidden
    out: Table = [("embeddings.patch_embedding.weight", (h, v.in_channels, v.patch, v.patch)),
                  ("embeddings.patch_embedding.bias", (h,)),
                  ("embeddings.position_embedding.weight", (v.positions, h))]
    for i in range(v.depth):
        b = f"encoder.layers.{i}."
        out += [*_norm(b + "layer_norm1", h), *_linear(b + "self_attn.k_proj", h, h),
                *_linear(b + "self_attn.v_proj", h, h), *_linear(b + "self_attn.q_proj", h, h),
                *_linear(b + "self_attn.out_proj", h, h), *_norm(b + "layer_norm2", h),
                *_linear(b + "mlp.fc1", v.ffn, h), *_linear(b + "mlp.fc2", h, v.ffn)]
    out += _norm("post_layernorm", h)
    if v.head:
        out += [("head.probe", (1, 1, h)), ("head.attention.in_proj_weight", (3 * h, h)),
                ("head.attention.in_proj_bias", (3 * h,)), *_linear("head.attention.out_proj", h, h),
                *_norm("head.layernorm", h), *_linear("head.mlp.fc1", v.ffn, h), *_linear("head.mlp.fc2", h, v.ffn)]
    return out


def glm4v_tower(cfg: ModelConfig) -> Table:
    """transformers' ``Glm4vVisionModel``: learned positions, the Conv3d patch embedding, blocks of RMSNorm pre-norms,
    a fused q/k/v (its bias by the config), an unbiased projection and a gated SiLU MLP of the output's width, the
    post-convolution and post norms, a Conv2d merging ``merge x merge`` patches to the output width, and the gated
    merger (a projection, a LayerNorm, a SiLU-gated MLP of width ``ffn``)."""
    v = cfg.vision
    h, o = v.hidden, v.out_hidden
    out: Table = [("embeddings.position_embedding.weight", (v.positions, h)),
                  ("patch_embed.proj.weight", (h, v.in_channels, v.temporal_patch, v.patch, v.patch)),
                  ("patch_embed.proj.bias", (h,))]
    for i in range(v.depth):
        b = f"blocks.{i}."
        qkv = _linear(b + "attn.qkv", 3 * h, h)
        out += [(b + "norm1.weight", (h,)), (b + "norm2.weight", (h,)), *(qkv if v.qkv_bias else qkv[:1]),
                (b + "attn.proj.weight", (h, h)), (b + "mlp.gate_proj.weight", (o, h)),
                (b + "mlp.up_proj.weight", (o, h)), (b + "mlp.down_proj.weight", (h, o))]
    return out + [("merger.proj.weight", (o, o)), *_norm("merger.post_projection_norm", o),
                  ("merger.gate_proj.weight", (v.ffn, o)), ("merger.up_proj.weight", (v.ffn, o)),
                  ("merger.down_proj.weight", (o, v.ffn)), ("post_conv_layernorm.weight", (h,)),
                  ("downsample.weight", (o, h, v.merge, v.merge)), ("downsample.bias", (o,)),
                  ("post_layernorm.weight", (h,))]


def pixtral_tower(cfg: ModelConfig) -> Table:
    """transformers' ``PixtralVisionModel`` under ``vision_tower.`` (the unbiased patch convolution, RMSNorms,
    separate q/k/v/o, a gated MLP) and Mistral 3's ``multi_modal_projector.`` (its RMSNorm, the patch merger's linear
    over ``merge x merge`` patches, two linears to the language model's width)."""
    v = cfg.vision
    h, heads = v.hidden, v.heads * v.head_size
    out: Table = [("vision_tower.patch_conv.weight", (h, v.in_channels, v.patch, v.patch)),
                  ("vision_tower.ln_pre.weight", (h,))]
    for i in range(v.depth):
        b = f"vision_tower.transformer.layers.{i}."
        out += [(b + "attention_norm.weight", (h,)), (b + "feed_forward.gate_proj.weight", (v.ffn, h)),
                (b + "feed_forward.up_proj.weight", (v.ffn, h)), (b + "feed_forward.down_proj.weight", (h, v.ffn)),
                *((b + f"attention.{x}_proj.weight", (heads, h)) for x in "kvq"),
                (b + "attention.o_proj.weight", (h, heads)), (b + "ffn_norm.weight", (h,))]
    p, lm = "multi_modal_projector.", cfg.hidden_size
    return out + [(p + "norm.weight", (h,)), (p + "patch_merger.merging_layer.weight", (h, h * v.merge * v.merge)),
                  *(_linear(p + "linear_1", lm, h) if v.projector_bias else [(p + "linear_1.weight", (lm, h))]),
                  *(_linear(p + "linear_2", lm, lm) if v.projector_bias else [(p + "linear_2.weight", (lm, lm))])]


def moonvit_tower(cfg: ModelConfig) -> Table:
    """Kimi-K2.5's MoonViT under ``vision_tower.`` and its projector under ``mm_projector.``, with the release's names
    (the Hub's model code; transformers 5.23 reads them, and Megatron-Bridge keeps them): the biased patch
    convolution, the learned position grid, blocks of LayerNorms, a fused q/k/v, the output projection and a two-linear
    MLP, the final LayerNorm; the projector's LayerNorm on the tower's width and two linears on the merged width."""
    v = cfg.vision
    h, m = v.hidden, v.merged
    p = "vision_tower.patch_embed."
    out: Table = [(p + "proj.weight", (h, v.in_channels, v.patch, v.patch)), (p + "proj.bias", (h,)),
                  (p + "pos_emb.weight", (v.pos_height, v.pos_width, h))]
    for i in range(v.depth):
        b = f"vision_tower.encoder.blocks.{i}."
        out += [*_norm(b + "norm0", h), *_linear(b + "wqkv", 3 * h, h), *_linear(b + "wo", h, h),
                *_norm(b + "norm1", h), *_linear(b + "mlp.fc0", v.ffn, h), *_linear(b + "mlp.fc1", h, v.ffn)]
    return out + [*_norm("vision_tower.encoder.final_layernorm", h), *_norm("mm_projector.pre_norm", h),
                  *_linear("mm_projector.proj.0", m, m), *_linear("mm_projector.proj.2", v.out_hidden, m)]


QWEN2_5_VL = HFModule("visual.", qwen2_5_vl_tower)
MOONVIT = HFModule("", moonvit_tower)
PIXTRAL = HFModule("", pixtral_tower)
GLM4V = HFModule("visual.", glm4v_tower)
# Gemma 3's projector (Bridge's Gemma3VLMultimodalProjector): the soft-embedding RMSNorm on the tower's width, then a
# column-parallel projection to the language model's
SIGLIP = HFModule("vision_tower.", siglip_tower, projector=(
    Rule(PROJECTOR + "mm_soft_embed_norm.weight", Kind.REP, _vh),
    Rule(PROJECTOR + "proj.weight", Kind.COL, lambda c: (c.hidden_size, c.vision.hidden))))

# -- each tower's table, by its record type ------------------------------------------------------------------------
TOWER_LAYOUTS: dict[type[Vision], TowerLayout] = {Qwen3VLTower: MegatronQwen3VL(), Qwen25VLTower: QWEN2_5_VL,
                                                  SiglipTower: SIGLIP, Glm4vTower: GLM4V, PixtralTower: PIXTRAL,
                                                  MoonViTTower: MOONVIT}
assert set(TOWER_LAYOUTS) == set(TOWERS.values()), "one layout per vision tower"


def tower_layout(vision: Vision) -> TowerLayout:
    """The table of the model's tower."""
    return TOWER_LAYOUTS[type(vision)]
