"""Ministral 3: the text model (``Ministral3ForCausalLM``: Mistral's GQA and SwiGLU with YaRN RoPE and Llama 4's query
scaling by position, ``Position.query_scale_beta``, read from and written to ``rope_parameters.llama_4_scaling_beta``)
and with images (``Mistral3ForConditionalGeneration``: that language model under transformers' Pixtral encoder and
Mistral 3's multimodal projector, which Megatron-Bridge 0.6.2 keeps whole and replicated under ``vision_tower.`` and
``multi_modal_projector.``: ``features.vision.PixtralTower``, ``layout/vision.py``). On disk, transformers 4's names,
which its ``save_pretrained`` still writes: ``language_model.model.*``, ``language_model.lm_head``,
``vision_tower.*``, ``multi_modal_projector.*``.

Megatron-LM's builder has no query scaling (a torch_dist target says so in one warning); Megatron-Bridge's Ministral 3
model applies it from the HF config its provider carries.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..config import ModelConfig
from ..errors import ConvertError
from ..features.expressed import ANY, Allowed
from ..features.vision import PixtralTower
from ..layout.vision import PIXTRAL
from .base import require_int
from .llama import Llama
from .rows import Plain, Row
from .vlm import VisionLanguage, text_of, token_expresses, token_ids, vision_config, vision_record

TOKENS = {"image_token_index": "image_token_id"}
PIXTRAL_EPS = 1e-5  # transformers' PixtralRMSNorm epsilon (no config key)
TOWER_ACTIVATIONS = ("silu", "gelu")  # the gate of Pixtral's MLP: the releases' silu, PixtralVisionConfig's default
# vision_config key -> PixtralTower field, with transformers' PixtralVisionConfig default
VISION = {"num_hidden_layers": ("depth", 24), "hidden_size": ("hidden", 1024), "num_attention_heads": ("heads", 16),
          "intermediate_size": ("ffn", 4096), "patch_size": ("patch", 14), "num_channels": ("in_channels", 3),
          "image_size": ("image_size", 1540), "head_dim": ("head_size", 64)}


@dataclass(frozen=True, kw_only=True)
class Ministral3(Llama):
    """Mistral with YaRN and Llama 4's query scaling."""

    @property
    def hf_keys(self) -> frozenset[str]:
        return super().hf_keys | {"rope.llama_4_scaling_beta"}

    def expresses(self) -> Mapping[str, Allowed]:
        return {**super().expresses(), "position.query_scale_beta": ANY}


TEXT = Ministral3(architecture="Ministral3ForCausalLM", model_type="ministral3", window=True)


@dataclass(frozen=True, kw_only=True)
class Mistral3(VisionLanguage):
    architecture: str = "Mistral3ForConditionalGeneration"
    model_type: str = "mistral3"
    text: Any = TEXT

    def lm_name(self, name: str) -> str:
        return f"language_model.{name}"  # transformers 4's names, which its save_pretrained still writes

    def text_config(self, hf: dict[str, Any]) -> dict[str, Any]:
        return text_of(hf, tied=True)  # transformers' Mistral3Config ties by default, at the top level

    def text_model_type(self, hf: dict[str, Any]) -> str:
        return str((hf.get("text_config") or {}).get("model_type") or TEXT.model_type)

    def with_vision(self, cfg: ModelConfig, hf: dict[str, Any], text: dict[str, Any]) -> ModelConfig:
        v = vision_config(hf, self.architecture)
        if int(hf.get("vision_feature_layer", -1)) != -1:
            raise ConvertError(f"vision_feature_layer={hf['vision_feature_layer']}: Megatron-Bridge's Ministral 3 "
                               "takes the tower's last layer", "convert a config with vision_feature_layer -1")
        act, projector = v.get("hidden_act", "gelu"), hf.get("projector_hidden_act", "gelu")
        if act not in TOWER_ACTIVATIONS or projector != "gelu":
            raise ConvertError(f"vision_config.hidden_act={act!r} / projector_hidden_act={projector!r}: Mistral 3's "
                               f"Pixtral tower gates with {' or '.join(TOWER_ACTIVATIONS)} here, its projector with "
                               "gelu", "convert a config with the released activations")
        sizes = {field: int(v.get(key, default)) for key, (field, default) in VISION.items()}
        rope = v.get("rope_parameters") or {}
        vision = vision_record(PixtralTower, **sizes, out_hidden=cfg.hidden_size, activation=act, eps=PIXTRAL_EPS,
                               rope_base=float(rope.get("rope_theta", v.get("rope_theta", 10000.0))),
                               merge=require_int(hf, "spatial_merge_size", default=2),
                               projector_bias=bool(hf.get("multimodal_projector_bias", False)),
                               **token_ids(hf, TOKENS))
        return cfg.replace(vision=vision)

    def text_model(self, cfg: ModelConfig) -> ModelConfig:
        return cfg.replace(vision=None)  # its RoPE is the text model's own (no multimodal RoPE)

    def vision_to_hf(self, hf: dict[str, Any], text: dict[str, Any], vision: dict[str, Any], cfg: ModelConfig) -> None:
        text["model_type"] = (hf.get("text_config") or {}).get("model_type", TEXT.model_type)
        v = cfg.vision
        vision.setdefault("model_type", "pixtral")
        vision.update({key: getattr(v, field) for key, (field, _) in VISION.items()}, hidden_act=v.activation)
        if "rope_parameters" in vision or "rope_theta" not in vision:
            vision["rope_parameters"] = {**vision.get("rope_parameters", {}), "rope_type": "default",
                                         "rope_theta": v.rope_base}
        else:
            vision["rope_theta"] = v.rope_base
        hf.update(spatial_merge_size=v.merge, projector_hidden_act="gelu", multimodal_projector_bias=v.projector_bias,
                  vision_feature_layer=-1)
        hf.update({k: getattr(v, f) for k, f in TOKENS.items() if getattr(v, f) is not None})

    def vision_expresses(self) -> dict[str, Allowed]:
        return {"vision.tower": {PixtralTower.tower}, "vision.activation": set(TOWER_ACTIVATIONS),
                "vision.eps": {PIXTRAL_EPS},
                "vision.rope_base": ANY, "vision.projector_activation": {"gelu"},
                **token_expresses(TOKENS.values())}

    def component_names(self, cfg: ModelConfig) -> list[Row]:
        return [Plain(hf=name, logical=name) for name, _ in PIXTRAL.names(cfg)]


FAMILIES = (TEXT, Mistral3())
