"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``): a Qwen2 language model (GQA with q/k/v biases, SwiGLU,
RMSNorm, megatron-core's multimodal RoPE: sections one after the other) plus transformers' own Qwen2.5-VL vision
transformer (windowed attention but on ``fullatt_block_indexes``, a gated SiLU MLP, RMSNorm), which Megatron-Bridge
0.6.2 keeps whole and replicated under ``visual.`` (``layout/vision.py``).

On disk (the releases, and transformers 5's ``save_pretrained``) the names are transformers 4's: ``model.layers.*``,
``model.embed_tokens``, ``model.norm``, ``lm_head`` and ``visual.*``.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..config import ModelConfig
from ..errors import ConvertError
from ..features.expressed import ANY, Allowed
from ..features.vision import Qwen25VLTower
from ..layout.vision import QWEN2_5_VL
from .base import require_int
from .llama import FAMILIES as LLAMA_FAMILIES
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

TOKENS = {k: k for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
                         "vision_token_id")}
FULL_LAYERS = (7, 15, 23, 31)  # transformers' default fullatt_block_indexes (the releases')


@dataclass(frozen=True, kw_only=True)
class Qwen25VL(VisionLanguage):
    architecture: str = "Qwen2_5_VLForConditionalGeneration"
    model_type: str = "qwen2_5_vl"
    text: Any = next(f for f in LLAMA_FAMILIES if f.architecture == "Qwen2ForCausalLM")

    def lm_name(self, name: str) -> str:
        return name

    def text_config(self, hf: dict[str, Any]) -> dict[str, Any]:
        """transformers 4's flat config.json (the releases: the language model's keys at the top, RoPE as
        ``rope_scaling: {type: mrope, mrope_section}``) as transformers 5 reads it: a text config, RoPE type default."""
        if not isinstance(hf.get("text_config"), dict):
            hf = {**hf, "text_config": {k: v for k, v in hf.items() if k not in ("vision_config", "architectures")}}
        text = text_of(hf)
        for key in ("rope_scaling", "rope_parameters"):
            p = text.get(key)
            if isinstance(p, dict) and p.get("rope_type", p.get("type")) == "mrope":
                text[key] = {**{k: v for k, v in p.items() if k != "type"}, "rope_type": "default"}
        return text

    def with_vision(self, cfg: ModelConfig, hf: dict[str, Any], text: dict[str, Any]) -> ModelConfig:
        v = vision_config(hf, self.architecture)
        if v.get("hidden_act", "silu") != "silu":
            raise ConvertError(f"vision_config.hidden_act={v['hidden_act']!r}: Qwen2.5-VL's tower gates with SiLU",
                               "convert a config with the released activation")
        vision = vision_record(
            Qwen25VLTower, depth=require_int(v, "depth"), hidden=require_int(v, "hidden_size"),
            heads=require_int(v, "num_heads"), ffn=require_int(v, "intermediate_size"),
            out_hidden=require_int(v, "out_hidden_size"), patch=int(v.get("patch_size", 14)),
            temporal_patch=int(v.get("temporal_patch_size", 2)), in_channels=int(v.get("in_channels", 3)),
            merge=int(v.get("spatial_merge_size", 2)), window=int(v.get("window_size", 112)),
            full_layers=tuple(int(i) for i in v.get("fullatt_block_indexes", FULL_LAYERS)),
            tokens_per_second=int(v.get("tokens_per_second", 4)), activation="silu", **token_ids(hf, TOKENS))
        return mrope_position(cfg, text, self.architecture, interleaved=False).replace(vision=vision)

    def vision_to_hf(self, hf: dict[str, Any], text: dict[str, Any], vision: dict[str, Any], cfg: ModelConfig) -> None:
        write_mrope(text, cfg)
        v = cfg.vision
        vision.setdefault("model_type", "qwen2_5_vl_vision")
        vision.update(depth=v.depth, hidden_size=v.hidden, num_heads=v.heads, intermediate_size=v.ffn,
                      out_hidden_size=v.out_hidden, patch_size=v.patch, temporal_patch_size=v.temporal_patch,
                      in_channels=v.in_channels, spatial_merge_size=v.merge, window_size=v.window,
                      fullatt_block_indexes=list(v.full_layers), tokens_per_second=v.tokens_per_second,
                      hidden_act="silu")
        hf.update({k: getattr(v, f) for k, f in TOKENS.items() if getattr(v, f) is not None})

    def expresses(self) -> Mapping[str, Allowed]:
        return unscaled_rope(super().expresses())

    def vision_expresses(self) -> dict[str, Allowed]:
        return {"position.kind": {"mrope"}, "position.mrope_section": ANY, "vision.tower": {Qwen25VLTower.tower},
                "vision.activation": {"silu"}, "vision.eps": {1e-6}, "vision.window": ANY, "vision.full_layers": ANY,
                "vision.tokens_per_second": ANY, **token_expresses(TOKENS.values())}

    def component_names(self, cfg: ModelConfig) -> list[Row]:
        return [Plain(hf=name, logical=name) for name, _ in QWEN2_5_VL.names(cfg)]


FAMILIES = (Qwen25VL(),)
