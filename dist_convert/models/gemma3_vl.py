"""Gemma 3 with images (``Gemma3ForConditionalGeneration``): the Gemma 3 language model (``models/gemma3.py``) plus
transformers' SigLIP vision encoder, which Megatron-Bridge 0.6.2 keeps whole and replicated under ``vision_tower.``,
and Bridge's multimodal projector (``multi_modal_projector.``: the soft-embedding RMSNorm, replicated, and the
projection to the language model's width, column-parallel; ``layout/vision.py``).

On disk (the releases, and transformers 5's ``save_pretrained``) the language model is under ``language_model.``
(``language_model.model.layers.*``), the tower under ``vision_tower.`` and the projection is stored transposed
(``multi_modal_projector.mm_input_projection_weight`` [vision width, text width]). Some releases nest the tower one
level deeper (``vision_tower.vision_model.*``): read as such; written flattened, as transformers 5 saves it.
"""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from ..config import ModelConfig
from ..errors import ConvertError
from ..features.expressed import ANY, Allowed
from ..features.vision import SiglipTower
from ..layout.vision import PROJECTOR, SIGLIP
from .base import HFTensors, part_pieces, require_int
from .gemma3 import FAMILIES as GEMMA3_FAMILIES
from .gemma3 import GELU_TANH
from .rows import Plain, Row, Transposed
from .vlm import VisionLanguage, text_of, token_expresses, token_ids, vision_config, vision_record

# transformers' Gemma3TextConfig defaults (4.5x and 5.14 agree), which the releases' sparse text_config relies on
TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262208, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6, "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0, "attn_logit_softcapping": None, "final_logit_softcapping": None,
    "attention_bias": False}
# config.json key -> SiglipTower field
TOKENS = {"image_token_index": "image_token_id", "boi_token_index": "vision_start_token_id",
          "eoi_token_index": "vision_end_token_id"}
NESTED = "vision_tower.vision_model."  # the older releases' spelling of the tower's prefix
PROJECTOR_NAMES: tuple[Row, ...] = (
    Transposed(hf=PROJECTOR + "mm_input_projection_weight", logical=PROJECTOR + "proj.weight"),
    Plain(hf=PROJECTOR + "mm_soft_emb_norm.weight", logical=PROJECTOR + "mm_soft_embed_norm.weight"))


@dataclass(frozen=True, kw_only=True)
class Gemma3VL(VisionLanguage):
    architecture: str = "Gemma3ForConditionalGeneration"
    model_type: str = "gemma3"
    text: Any = GEMMA3_FAMILIES[0]

    def lm_name(self, name: str) -> str:
        return "language_model." + name

    def text_config(self, hf: dict[str, Any]) -> dict[str, Any]:
        """The releases' text_config states only what differs from Gemma3TextConfig's defaults: those fill the rest."""
        return {**TEXT_DEFAULTS, **text_of(hf, tied=True)}  # Gemma3Config ties by default

    def with_vision(self, cfg: ModelConfig, hf: dict[str, Any], text: dict[str, Any]) -> ModelConfig:
        v = vision_config(hf, self.architecture)
        act = v.get("hidden_act", "gelu_pytorch_tanh")
        if act not in GELU_TANH:
            raise ConvertError(f"vision_config.hidden_act={act!r}: Gemma 3's SigLIP tower runs tanh-GELU",
                               "convert a config with the released activation")
        size, patch = require_int(v, "image_size"), require_int(v, "patch_size")
        tokens = int(hf.get("mm_tokens_per_image", 256))
        side = int(round(tokens ** 0.5))
        if size % patch or side * side != tokens or (size // patch) % side:
            raise ConvertError(f"vision_config image_size {size} / patch_size {patch} with mm_tokens_per_image "
                               f"{tokens}: the projector pools a square grid of patches into a square of tokens",
                               "use the config.json saved with the model")
        vision = vision_record(
            SiglipTower, depth=require_int(v, "num_hidden_layers"), hidden=require_int(v, "hidden_size"),
            heads=require_int(v, "num_attention_heads"), ffn=require_int(v, "intermediate_size"),
            out_hidden=cfg.hidden_size, patch=patch, in_channels=int(v.get("num_channels", 3)), image_size=size,
            activation="gelu_tanh", eps=float(v.get("layer_norm_eps", 1e-6)),
            head=bool(v.get("vision_use_head", True)), mm_tokens=tokens, **token_ids(hf, TOKENS))
        return cfg.replace(vision=vision)

    def vision_to_hf(self, hf: dict[str, Any], text: dict[str, Any], vision: dict[str, Any], cfg: ModelConfig) -> None:
        v = cfg.vision
        vision.setdefault("model_type", "siglip_vision_model")
        vision.update(num_hidden_layers=v.depth, hidden_size=v.hidden, num_attention_heads=v.heads,
                      intermediate_size=v.ffn, patch_size=v.patch, num_channels=v.in_channels,
                      image_size=v.image_size, hidden_act="gelu_pytorch_tanh", layer_norm_eps=v.eps)
        if "vision_use_head" in vision or not v.head:  # SiglipVisionConfig's default: True
            vision["vision_use_head"] = v.head
        hf["mm_tokens_per_image"] = v.mm_tokens
        hf.update({k: getattr(v, f) for k, f in TOKENS.items() if getattr(v, f) is not None})

    def vision_expresses(self) -> dict[str, Allowed]:
        return {"vision.tower": {SiglipTower.tower}, "vision.activation": {"gelu_tanh"}, "vision.eps": ANY,
                "vision.mm_tokens": ANY, **token_expresses(TOKENS.values())}

    def component_names(self, cfg: ModelConfig) -> list[Row]:
        return [Plain(hf=name, logical=name) for name, _ in SIGLIP.names(cfg)] + list(PROJECTOR_NAMES)

    def alternatives(self, cfg: ModelConfig, found: Collection[str], expected: HFTensors) -> HFTensors:
        """The tower under ``vision_tower.vision_model.`` where the checkpoint nests it so."""
        if not any(k.startswith(NESTED) for k in found):
            return {}
        return {NESTED + name.removeprefix(SIGLIP.prefix): part_pieces(name, shape, None, cfg)
                for name, shape in SIGLIP.names(cfg)}


FAMILIES = (Gemma3VL(),)
