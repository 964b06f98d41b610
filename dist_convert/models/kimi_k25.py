"""Kimi-K2.5 with images (``Kimi_K25ForConditionalGeneration``, transformers 5.23): the DeepSeek-V3 language model
(``models/deepseek.py``: MLA, the sigmoid router with its correction bias, shared experts, dense first layers) under
Kimi's MoonViT vision tower and patch-merger projector, which Megatron-Bridge 0.6.2 keeps whole and replicated under
``vision_tower.`` and ``mm_projector.`` (``features.vision.MoonViTTower``, ``layout/vision.py``).

On disk, the release's names (the Hub's model code; transformers 5.23 reads them through its conversion mapping, and
Bridge keeps them): ``language_model.model.layers.*``, ``language_model.lm_head``, ``vision_tower.patch_embed.*``,
``vision_tower.encoder.blocks.*`` (fused ``wqkv``), ``mm_projector.*``. transformers 5.23's own ``save_pretrained``
spells three of them otherwise (``language_model.model.blocks.*``, ``vision_tower.encoder.patch_embed.proj.*``,
``model.mm_projector.pre_norm.*``): read as such, written as the release spells them.

transformers' class builds no multi-token-prediction layer (its text config's ``num_nextn_predict_layers`` is unread):
none is converted, and the key goes back as the source wrote it.
"""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from ..config import ModelConfig
from ..errors import ConvertError
from ..features.expressed import ANY, Allowed
from ..features.vision import MoonViTTower
from ..layout.vision import MOONVIT
from .base import HFTensors
from .deepseek import FAMILIES as DEEPSEEK_FAMILIES
from .rows import Plain, Row
from .vlm import VisionLanguage, text_of, token_expresses, token_ids, vision_config, vision_record

TOKENS = {k: k for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")}
TEXT_MODEL_TYPE = "deepseek_v3"  # what transformers reads text_config as (the Hub's "kimi_k2" included)
# keys DeepSeek-V3's releases write that transformers' DeepseekV3Config neither has nor reads (its router is always
# sigmoid, noaux_tc, from first_k_dense_replace): written only where the source's text config had them
NOT_IN_TEXT = ("moe_layer_freq", "scoring_func", "topk_method")
MOONVIT_EPS = 1e-5  # the tower's LayerNorms (transformers: no config key)
# the tower's rope_type: transformers 5.23 says "axial", 5.14 "default" for the same 2-D RoPE, and each refuses the
# other's: kept as the source spelled it, "axial" where written anew
AXIAL = ("axial", "default")
# vision_config key -> MoonViTTower field, with transformers' Kimi_K25VisionConfig default
VISION = {"num_hidden_layers": ("depth", 27), "hidden_size": ("hidden", 1152), "num_attention_heads": ("heads", 16),
          "intermediate_size": ("ffn", 4304), "patch_size": ("patch", 14), "pos_emb_height": ("pos_height", 64),
          "pos_emb_width": ("pos_width", 64), "pos_emb_time": ("pos_time", 4)}
# transformers 5.23's save_pretrained spelling -> the release's
SAVED_SPELLING = (("language_model.model.blocks.", "language_model.model.layers."),
                  ("vision_tower.encoder.patch_embed.proj.", "vision_tower.patch_embed.proj."),
                  ("model.mm_projector.pre_norm.", "mm_projector.pre_norm."))


def saved_spelling(name: str) -> str:
    """The name transformers 5.23's ``save_pretrained`` gives the release's tensor ``name``."""
    for saved, release in SAVED_SPELLING:
        if name.startswith(release):
            return saved + name.removeprefix(release)
    return name


@dataclass(frozen=True, kw_only=True)
class KimiK25(VisionLanguage):
    architecture: str = "Kimi_K25ForConditionalGeneration"
    model_type: str = "kimi_k25"
    text: Any = DEEPSEEK_FAMILIES[0]

    def lm_name(self, name: str) -> str:
        return "language_model." + name

    def text_config(self, hf: dict[str, Any]) -> dict[str, Any]:
        """The text config as transformers' class builds it: DeepSeek-V3 without MTP layers (Kimi_K25Config ties by
        default, at the top level)."""
        return {**text_of(hf, tied=True), "model_type": TEXT_MODEL_TYPE, "num_nextn_predict_layers": 0}

    def text_model_type(self, hf: dict[str, Any]) -> str:
        return TEXT_MODEL_TYPE

    def with_vision(self, cfg: ModelConfig, hf: dict[str, Any], text: dict[str, Any]) -> ModelConfig:
        v = vision_config(hf, self.architecture)
        act = v.get("hidden_act", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ConvertError(f"vision_config.hidden_act={act!r}: Kimi-K2.5's MoonViT runs tanh-GELU",
                               "convert a config with the released activation")
        kernel = list(v.get("merge_kernel_size", (2, 2)))
        rope = v.get("rope_parameters") or {}
        if len(kernel) != 2 or kernel[0] != kernel[1] or rope.get("rope_type", "axial") not in AXIAL:
            raise ConvertError(f"vision_config merge_kernel_size {kernel} / rope_type {rope.get('rope_type')!r}: "
                               "Kimi-K2.5's tower merges square groups of patches and rotates with axial RoPE here",
                               "use the config.json saved with the model")
        sizes = {field: int(v.get(key, default)) for key, (field, default) in VISION.items()}
        vision = vision_record(MoonViTTower, **sizes, out_hidden=cfg.hidden_size, activation="gelu_tanh",
                               eps=MOONVIT_EPS, merge=int(kernel[0]), rope_base=float(rope.get("rope_theta", 10000.0)),
                               projector_eps=float(hf.get("projection_layer_norm_eps", 1e-5)), **token_ids(hf, TOKENS))
        projection = int(hf.get("projection_hidden_size", 1152))
        if projection != vision.hidden:
            raise ConvertError(f"projection_hidden_size {projection} is not the vision tower's hidden_size "
                               f"{vision.hidden}: Kimi-K2.5's projector normalizes the tower's output",
                               "use the config.json saved with the model")
        return cfg.replace(vision=vision)

    def text_model(self, cfg: ModelConfig) -> ModelConfig:
        return cfg.replace(vision=None)  # its RoPE is the text model's own (no multimodal RoPE)

    def vision_to_hf(self, hf: dict[str, Any], text: dict[str, Any], vision: dict[str, Any], cfg: ModelConfig) -> None:
        kept = hf.get("text_config") or {}
        for key in NOT_IN_TEXT if kept else ():
            if key not in kept:
                text.pop(key, None)
        text["model_type"] = kept.get("model_type", TEXT_MODEL_TYPE)
        text["num_nextn_predict_layers"] = kept.get("num_nextn_predict_layers", 0)  # unread by transformers' class
        v = cfg.vision
        vision.setdefault("model_type", "kimi_k25_vision")
        vision.update({key: getattr(v, field) for key, (field, _) in VISION.items()}, hidden_act="gelu_pytorch_tanh",
                      merge_kernel_size=[v.merge, v.merge],
                      rope_parameters={"rope_type": "axial", **vision.get("rope_parameters", {}),
                                       "rope_theta": v.rope_base})
        hf.update(projection_hidden_size=v.hidden, projection_layer_norm_eps=v.projector_eps)
        hf.update({k: getattr(v, f) for k, f in TOKENS.items() if getattr(v, f) is not None})

    def vision_expresses(self) -> dict[str, Allowed]:
        return {"mtp": {False}, "vision.tower": {MoonViTTower.tower}, "vision.activation": {"gelu_tanh"},
                "vision.eps": {MOONVIT_EPS}, "vision.rope_base": ANY, "vision.projector_eps": ANY,
                **token_expresses(TOKENS.values())}

    def component_names(self, cfg: ModelConfig) -> list[Row]:
        return [Plain(hf=name, logical=name) for name, _ in MOONVIT.names(cfg)]

    def alternatives(self, cfg: ModelConfig, found: Collection[str], expected: HFTensors) -> HFTensors:
        """transformers 5.23's own spelling (``SAVED_SPELLING``) where the checkpoint is spelled so."""
        if saved_spelling(MOONVIT.names(cfg)[0][0]) not in found:
            return {}
        return {saved_spelling(name): pieces for name, pieces in expected.items() if saved_spelling(name) != name}


FAMILIES = (KimiK25(),)
