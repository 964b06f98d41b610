"""Qwen3-VL (``Qwen3VLForConditionalGeneration``, ``Qwen3VLMoeForConditionalGeneration``): a Qwen3 or Qwen3-MoE
language model (GQA, q/k RMSNorm, SwiGLU, interleaved multimodal RoPE) plus the Qwen3-VL vision tower
(``features.vision``), as Megatron-Bridge 0.6.2 lays it out. Qwen3.5 with images (``Qwen3_5ForConditionalGeneration``,
``Qwen3_5MoeForConditionalGeneration``): the Qwen3.5 Gated DeltaNet language model (``qwen3_next.py``; its MRoPE on
the rotated share of the head) under the same tower without deepstack mergers (Bridge's Qwen3.5-VL bridges).

``config.json`` nests the two: ``text_config`` (read as a Qwen3 config, its ``rope_parameters`` carrying
``mrope_section``), ``vision_config``, and at the top the image/video token ids and ``tie_word_embeddings`` (which
Bridge and transformers read there, not in ``text_config``). The tower's tensors: transformers 5's names under
``model.visual.``; the language model's under ``model.language_model.``. The MoE variant's router renormalises its
top-k (no ``norm_topk_prob`` key). The releases store a layer's experts fused and transposed,
``mlp.experts.gate_up_proj`` [E, H, 2F] ([gate | up] on the last axis) and ``mlp.experts.down_proj`` [E, F, H];
transformers 5's ``save_pretrained`` writes its own [E, 2F, H] / [E, H, F] (its loader takes either, by shape). Both
are read, and per-expert ``mlp.experts.{e}.gate_proj.weight`` tensors too; an export writes the releases' layout.
"""
from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from ..config import ModelConfig
from ..errors import ConvertError
from ..features.expressed import ANY, Allowed
from ..features.vision import Qwen3VLTower
from ..layout.boxes import Box, Piece, View
from ..layout.rules import LAYER_PREFIX, logical_tensors
from ..layout.vision import DEEPSTACK, LAYER_RULES, MERGER, VISION_STACK
from .base import EXPERT_FC1, EXPERT_FC2, Family, HFTensors, Imported, part_pieces, require_int
from .llama import FAMILIES as LLAMA_FAMILIES
from .moe import FAMILIES as MOE_FAMILIES
from .moe import FUSED_FC1, FUSED_FC2, MoE
from .qwen3_next import FAMILIES as GDN_FAMILIES
from .qwen3_next import MROPE_AS_ROPE
from .rows import Plain, Row, StackedQKV, each, names, under
from .vlm import (
    VisionLanguage,
    mrope_position,
    text_of,
    token_expresses,
    token_ids,
    unscaled_rope,
    vision_config,
    vision_record,
    write_mrope,
)

VISUAL = "model.visual."
DEEPSTACK_DEFAULT = (8, 16, 24)  # transformers' default deepstack_visual_indexes
# the vision activations transformers names and Megatron-Bridge's tower builds (tanh-approximated GELU only)
VISION_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh"}
TOKENS = {k: k for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")}
# a tower block: HF suffix after ``model.visual.blocks.{i}.``, the tower layer's suffix after ``...layers.{i}.``
BLOCK_NAMES: tuple[Row, ...] = (
    Plain(hf="norm1.weight", logical="self_attention.linear_qkv.layer_norm_weight"),
    Plain(hf="norm1.bias", logical="self_attention.linear_qkv.layer_norm_bias"),
    StackedQKV(hf="attn.qkv.weight", logical="self_attention.linear_qkv.weight"),
    StackedQKV(hf="attn.qkv.bias", logical="self_attention.linear_qkv.bias"),
    *(Plain(hf=hf, logical=lg) for hf, lg in (
        ("attn.proj.weight", "self_attention.linear_proj.weight"),
        ("attn.proj.bias", "self_attention.linear_proj.bias"),
        ("norm2.weight", "mlp.linear_fc1.layer_norm_weight"),
        ("norm2.bias", "mlp.linear_fc1.layer_norm_bias"),
        ("mlp.linear_fc1.weight", "mlp.linear_fc1.weight"),
        ("mlp.linear_fc1.bias", "mlp.linear_fc1.bias"),
        ("mlp.linear_fc2.weight", "mlp.linear_fc2.weight"),
        ("mlp.linear_fc2.bias", "mlp.linear_fc2.bias"))),
)
# the merger's (after ``model.visual.merger.``; a deepstack merger's after ``deepstack_merger_list.{j}.``)
MERGER_NAMES: tuple[Row, ...] = (Plain(hf="norm.weight", logical="patch_norm.weight"),
                                 Plain(hf="norm.bias", logical="patch_norm.bias"),
                                 *(Plain(hf=f"linear_fc{i}.{p}", logical=f"linear_fc{i}.{p}")
                                   for i in (1, 2) for p in ("weight", "bias")))
assert {r.logical for r in BLOCK_NAMES} == {r.name for r in LAYER_RULES}, "one HF name per tower tensor"


def vision_from_hf(hf: dict[str, Any], arch: str, deepstack: bool = True) -> Qwen3VLTower:
    """The tower's record; ``deepstack``: the family's tower feeds deepstack features (Qwen3-VL; Qwen3.5's has none,
    whatever the config says: transformers' Qwen3.5 tower reads no deepstack indexes)."""
    v = vision_config(hf, arch)
    act = v.get("hidden_act", "gelu_pytorch_tanh")
    if act not in VISION_ACTIVATIONS:
        raise ConvertError(f"vision_config.hidden_act={act!r}: Megatron-Bridge's Qwen3-VL tower builds "
                           f"{', '.join(VISION_ACTIVATIONS)} only", "convert a config with the released activation")
    patch = v.get("patch_size", 16)
    if isinstance(patch, (list, tuple)) and len(set(patch)) == 1:
        patch = patch[0]
    vision = vision_record(Qwen3VLTower, depth=require_int(v, "depth"), hidden=require_int(v, "hidden_size"),
                           heads=require_int(v, "num_heads"), ffn=require_int(v, "intermediate_size"),
                           out_hidden=require_int(v, "out_hidden_size"), patch=int(patch),
                           temporal_patch=int(v.get("temporal_patch_size", 2)),
                           in_channels=int(v.get("in_channels", 3)), merge=int(v.get("spatial_merge_size", 2)),
                           positions=require_int(v, "num_position_embeddings"),
                           deepstack=tuple(int(i) for i in v.get("deepstack_visual_indexes", DEEPSTACK_DEFAULT))
                           if deepstack else (),
                           activation=VISION_ACTIVATIONS[act], **token_ids(hf, TOKENS))
    bad = [i for i in vision.deepstack if not 0 <= i < vision.depth]
    if bad:
        raise ConvertError(f"vision_config.deepstack_visual_indexes {list(vision.deepstack)} name layers outside the "
                           f"tower's {vision.depth}", "use the config.json saved with the model")
    return vision


def fused_experts(cfg: ModelConfig, layer: int, hf: str, transposed: bool) -> HFTensors:
    """A layer's experts in one tensor per linear (``hf``: the layer's HF prefix), expert e at index e: as the releases
    store them (``transposed``: fc1 [H, 2F], fc2 [F, H]) or as transformers 5 holds and saves them (fc1 [2F, H],
    fc2 [H, F])."""
    out: HFTensors = {}
    for fused, per_expert in ((FUSED_FC1, EXPERT_FC1), (FUSED_FC2, EXPERT_FC2)):
        rows, cols = (2 * cfg.expert_ffn, cfg.hidden_size) if fused == FUSED_FC1 else (cfg.hidden_size, cfg.expert_ffn)
        stored = (cols, rows) if transposed else (rows, cols)
        view = View(axes=(2, 1), steps=(1, 1, 1)) if transposed else None
        out[hf + fused] = ((cfg.num_experts, *stored), [
            Piece(f"{LAYER_PREFIX}{layer}.{per_expert.format(e=e)}", Box.full((rows, cols)),
                  Box((e, 0, 0), (1, *stored)), view=view) for e in range(cfg.num_experts)])
    return out


def release_layout(cfg: ModelConfig, found: Collection[str], hf: str) -> bool:
    """Whether a layer's fused experts are stored transposed, as the releases have them (transformers 5 loads either,
    saves its own [E, 2F, H]): from the stored shapes when ``found`` maps names to (file, dtype, shape) (the fc2 tells
    whenever F != H, fc1 when H != 2F), else yes: what an export writes, as the releases and Megatron-Bridge do."""
    shapes = found if isinstance(found, Mapping) else {}
    f, h = cfg.expert_ffn, cfg.hidden_size
    for name, release in ((FUSED_FC2, (f, h)), (FUSED_FC1, (h, 2 * f))):
        held = shapes.get(hf + name)
        if held is not None and release[0] != release[1]:
            return tuple(held[2][1:]) == release
    return True


@dataclass(frozen=True, kw_only=True)
class Qwen3VL(VisionLanguage):
    """Qwen3-VL, and Qwen3.5 with images (its Gated DeltaNet text family, the tower without deepstack)."""

    deepstack: bool = True  # the tower's deepstack mergers feed the first language layers
    vision_type: str = "qwen3_vl_vision"  # vision_config's model_type
    packed: bool = True  # the releases store a layer's experts fused (Qwen3-VL); else per expert (Qwen3.5)

    @property
    def experts(self) -> bool:
        return bool(getattr(self.text, "experts", isinstance(self.text, MoE)))

    @property
    def unconverted(self) -> dict[str, str]:  # type: ignore[override]
        return self.text.unconverted

    def from_hf(self, hf: dict[str, Any], vocab_divisible_by: int | None) -> Imported:
        imported = super().from_hf(hf, vocab_divisible_by)  # the multimodal RoPE is the model's here
        return Imported(cfg=imported.cfg, notes=[n for n in imported.notes if n != MROPE_AS_ROPE])

    def lm_name(self, name: str) -> str:
        return name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name

    def text_config(self, hf: dict[str, Any]) -> dict[str, Any]:
        text = text_of(hf)
        if self.experts:  # Qwen3-VL-MoE's router always renormalises its top-k
            if text.get("norm_topk_prob") is False:
                raise ConvertError(f"text_config.norm_topk_prob=false: {self.architecture}'s router always "
                                   "renormalises its top-k", "use the config.json saved with the model")
            text["norm_topk_prob"] = True
        return text

    def with_vision(self, cfg: ModelConfig, hf: dict[str, Any], text: dict[str, Any]) -> ModelConfig:
        # Qwen3-VL interleaves its MRoPE sections, whatever mrope_interleaved says
        cfg = mrope_position(cfg, text, self.architecture, interleaved=True)
        return cfg.replace(vision=vision_from_hf(hf, self.architecture, self.deepstack))

    def vision_to_hf(self, hf: dict[str, Any], text: dict[str, Any], vision: dict[str, Any], cfg: ModelConfig) -> None:
        write_mrope(text, cfg)
        v = cfg.vision
        vision.setdefault("model_type", self.vision_type)
        vision.update(depth=v.depth, hidden_size=v.hidden, num_heads=v.heads,
                      intermediate_size=v.ffn, out_hidden_size=v.out_hidden, patch_size=v.patch,
                      temporal_patch_size=v.temporal_patch, in_channels=v.in_channels, spatial_merge_size=v.merge,
                      num_position_embeddings=v.positions,
                      hidden_act=next(k for k, a in VISION_ACTIVATIONS.items() if a == v.activation))
        if self.deepstack:
            vision["deepstack_visual_indexes"] = list(v.deepstack)
        hf.update({k: getattr(v, f) for k, f in TOKENS.items() if getattr(v, f) is not None})

    def expresses(self) -> Mapping[str, Allowed]:
        return unscaled_rope(super().expresses())

    def vision_expresses(self) -> dict[str, Allowed]:
        return {"position.kind": {"mrope"}, "position.mrope_section": ANY, "position.mrope_interleaved": {True},
                "vision.tower": {Qwen3VLTower.tower}, "vision.deepstack": ANY if self.deepstack else {()},
                "vision.activation": set(VISION_ACTIVATIONS.values()), "vision.eps": {1e-6},
                **({"moe.pre_softmax": {False}} if self.experts else {}), **token_expresses(TOKENS.values())}

    def layer_names(self, cfg: ModelConfig, stack: str, layer: int) -> list[Row]:
        """The text family's rows; a MoE layer's experts are stored fused (``alternatives``)."""
        rows = self.text.layer_names(cfg, stack, layer)
        return [r for r in rows if not any(".experts." in h for h in r.hf_names())]

    def alternatives(self, cfg: ModelConfig, found: Collection[str], expected: HFTensors) -> HFTensors:
        """A MoE layer's experts: per expert where ``found`` holds them so, fused where it holds them fused, else as
        the family's releases store them (``packed``: Qwen3-VL's fused; Qwen3.5's per expert)."""
        out: HFTensors = {}
        logical = logical_tensors(cfg) if self.experts else {}
        for layer in range(cfg.num_layers) if self.experts else ():
            if not cfg.is_moe_layer(layer):
                continue
            hf = f"{self.hf_layers}{layer}."
            per_expert = [(h, lg, part) for h, lg, part in names(self.text.layer_names(cfg, "decoder", layer), hf=hf)
                          if ".experts." in h]
            fused = any(hf + n in found for n in (FUSED_FC1, FUSED_FC2))
            if any(h in found for h, _, _ in per_expert) or not (fused or self.packed):
                out.update({h: part_pieces(lg, logical[lg].shape, part, cfg) for h, lg, part in per_expert})
            else:
                out.update(fused_experts(cfg, layer, hf, release_layout(cfg, found, hf)))
        return out

    def component_names(self, cfg: ModelConfig) -> list[Row]:
        v = cfg.vision
        return [*(Plain(hf=f"{VISUAL}patch_embed.proj.{p}", logical=f"vision_model.patch_embed.proj.{p}")
                  for p in ("weight", "bias")),
                Plain(hf=f"{VISUAL}pos_embed.weight", logical="vision_model.pos_embed.weight"),
                *each(under(BLOCK_NAMES, f"{VISION_STACK}.layers.{{i}}.", f"{VISUAL}blocks.{{i}}."), i=range(v.depth)),
                *under(MERGER_NAMES, MERGER, f"{VISUAL}merger."),
                *each(under(MERGER_NAMES, DEEPSTACK, f"{VISUAL}deepstack_merger_list.{{j}}."),
                      j=range(len(v.deepstack)))]


def _family(families: tuple[Family, ...], arch: str) -> Family:
    return next(f for f in families if f.architecture == arch)


FAMILIES = (
    Qwen3VL(architecture="Qwen3VLForConditionalGeneration", model_type="qwen3_vl",
            text=_family(LLAMA_FAMILIES, "Qwen3ForCausalLM")),
    Qwen3VL(architecture="Qwen3VLMoeForConditionalGeneration", model_type="qwen3_vl_moe",
            text=_family(MOE_FAMILIES, "Qwen3MoeForCausalLM")),
    Qwen3VL(architecture="Qwen3_5ForConditionalGeneration", model_type="qwen3_5",
            text=_family(GDN_FAMILIES, "Qwen3_5ForCausalLM"), deepstack=False, vision_type="qwen3_5_vision",
            packed=False),
    Qwen3VL(architecture="Qwen3_5MoeForConditionalGeneration", model_type="qwen3_5_moe",
            text=_family(GDN_FAMILIES, "Qwen3_5MoeForCausalLM"), deepstack=False,
            vision_type="qwen3_5_moe_vision", packed=False),
)
