"""GLM-4.5V (``Glm4vMoeForConditionalGeneration``): the GLM-4.5 MoE language model (``models/glm.py``: GQA with q/k/v
biases, DeepSeek-V3's router and shared expert, dense first layers; no q/k norm, no MTP in transformers' class) with
multimodal RoPE on the rotated half of each head (sections one after the other, as Qwen2.5-VL's), plus transformers'
own GLM-4V vision transformer, which Megatron-Bridge 0.6.2 keeps whole and replicated under ``visual.``
(``features.vision.Glm4vTower``, ``layout/vision.py``). On disk: ``model.language_model.*``, ``model.visual.*``,
``lm_head``. The releases' multi-token-prediction layer (``layers.{num_hidden_layers}``), which transformers ignores,
is not converted.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..config import ModelConfig
from ..errors import ConvertError
from ..features.expressed import ANY, Allowed
from ..features.vision import Glm4vTower
from ..layout.vision import GLM4V
from .glm import Glm4Moe
from .rows import Plain, Row
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

TOKENS = {k: k for k in ("image_token_id", "video_token_id", "image_start_token_id", "image_end_token_id",
                         "video_start_token_id", "video_end_token_id")}
# keys of GLM-4.5's config that Glm4vMoe's text config has not: written only where the source's text config had them
NOT_IN_TEXT = ("num_nextn_predict_layers", "use_qk_norm", "partial_rotary_factor")
# vision_config key -> Glm4vTower field, with transformers' Glm4vMoeVisionConfig default
VISION = {"depth": ("depth", 24), "hidden_size": ("hidden", 1536), "num_heads": ("heads", 12),
          "intermediate_size": ("ffn", 13696), "out_hidden_size": ("out_hidden", 4096), "patch_size": ("patch", 14),
          "temporal_patch_size": ("temporal_patch", 2), "in_channels": ("in_channels", 3),
          "spatial_merge_size": ("merge", 2), "image_size": ("image_size", 336), "rms_norm_eps": ("eps", 1e-5),
          "attention_bias": ("qkv_bias", False)}


@dataclass(frozen=True, kw_only=True)
class Glm45V(VisionLanguage):
    architecture: str = "Glm4vMoeForConditionalGeneration"
    model_type: str = "glm4v_moe"
    text: Any = Glm4Moe()

    def lm_name(self, name: str) -> str:
        return name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name

    def text_config(self, hf: dict[str, Any]) -> dict[str, Any]:
        """The text config as GLM-4.5 reads it: no q/k norm, no MTP layer (transformers' Glm4vMoe builds neither)."""
        return {**text_of(hf), "use_qk_norm": False, "num_nextn_predict_layers": 0}

    def with_vision(self, cfg: ModelConfig, hf: dict[str, Any], text: dict[str, Any]) -> ModelConfig:
        v = vision_config(hf, self.architecture)
        if v.get("hidden_act", "silu") != "silu":
            raise ConvertError(f"vision_config.hidden_act={v['hidden_act']!r}: GLM-4V's tower gates with SiLU",
                               "convert a config with the released activation")
        sizes = {field: type(default)(v.get(key, default)) for key, (field, default) in VISION.items()}
        vision = vision_record(Glm4vTower, activation="silu", **sizes, **token_ids(hf, TOKENS))
        if vision.image_size % vision.patch:
            raise ConvertError(f"vision_config image_size {vision.image_size} is not a multiple of patch_size "
                               f"{vision.patch}", "use the config.json saved with the model")
        return mrope_position(cfg, text, self.architecture, interleaved=False).replace(vision=vision)

    def vision_to_hf(self, hf: dict[str, Any], text: dict[str, Any], vision: dict[str, Any], cfg: ModelConfig) -> None:
        kept = hf.get("text_config") or {}
        for key in NOT_IN_TEXT:
            if key not in kept:
                text.pop(key, None)
        write_mrope(text, cfg)
        v = cfg.vision
        vision.setdefault("model_type", "glm4v_moe_vision")
        vision.update({key: getattr(v, field) for key, (field, _) in VISION.items()}, hidden_act="silu")
        hf.update({k: getattr(v, f) for k, f in TOKENS.items() if getattr(v, f) is not None})

    def expresses(self) -> Mapping[str, Allowed]:
        return unscaled_rope(super().expresses())

    def vision_expresses(self) -> dict[str, Allowed]:
        return {"position.kind": {"mrope"}, "position.mrope_section": ANY, "attention.qk_norm": {False},
                "mtp": {False}, "vision.tower": {Glm4vTower.tower}, "vision.activation": {"silu"}, "vision.eps": ANY,
                **token_expresses(TOKENS.values())}

    def component_names(self, cfg: ModelConfig) -> list[Row]:
        return [Plain(hf=f"model.{name}", logical=name) for name, _ in GLM4V.names(cfg)]


FAMILIES = (Glm45V(),)
