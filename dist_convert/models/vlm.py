"""What the vision-language families share: a language model of an existing family (``text``) plus a vision component
(``features.vision``, ``layout/vision.py``).

``config.json`` nests the two: ``text_config`` (read and written by the text family, with the top-level
``tie_word_embeddings`` that transformers and Megatron-Bridge read for these models) and ``vision_config``; the
token ids that mark images sit at the top. The text family's HF tensor names move under the family's language-model
prefix (``lm_name``); the vision component's names are the family's ``component_names``. A family here defines its
tower's record (``features.vision``: one type per tower) both ways (``with_vision`` / ``vision_to_hf``) and what it
expresses beyond its text family.
"""
from __future__ import annotations

import copy
from abc import abstractmethod
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import torch

from ..config import ModelConfig
from ..errors import ConvertError
from ..features.expressed import ANY, Allowed
from ..features.vision import Vision
from .base import DTYPE_NAMES, Family, Imported, base_config, get
from .hf_keys import as_transformers_reads, unmapped
from .rows import Row

UNPADDED = 1
MROPE_KEYS = frozenset({"rope.mrope_section", "rope.mrope_interleaved"})


def text_of(hf: dict[str, Any], tied: bool = False) -> dict[str, Any]:
    """The language model's config.json keys: ``text_config`` with the top-level ``tie_word_embeddings`` (``tied``:
    transformers' default for the model when config.json does not say)."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise ConvertError("config.json of a vision-language model lacks text_config",
                           "use the config.json saved with the model")
    return {**copy.deepcopy(text), "tie_word_embeddings": bool(hf.get("tie_word_embeddings", tied))}


def vision_config(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    v = hf.get("vision_config")
    if not isinstance(v, dict):
        raise ConvertError(f"config.json of {arch} lacks vision_config", "use the config.json saved with the model")
    return v


def token_ids(hf: dict[str, Any], names: Mapping[str, str]) -> dict[str, int | None]:
    """The tower record's token-id fields from config.json (``names``: config.json key -> field)."""
    return {field: None if get(hf, key) is None else int(hf[key]) for key, field in names.items()}


def mrope_position(cfg: ModelConfig, text: dict[str, Any], arch: str, interleaved: bool) -> ModelConfig:
    """The language model with multimodal RoPE: ``mrope_section`` from the text config's RoPE parameters, which must
    cover half the rotated part of the head (transformers' rotary embedding and megatron-core's both assume so)."""
    params = text.get("rope_parameters") or text.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise ConvertError(f"text_config RoPE type {kind!r}: {arch}'s multimodal RoPE is unscaled here",
                           "convert a config whose rope_type is default")
    section = params.get("mrope_section")
    rotated = round(cfg.kv_channels * cfg.position.percent)
    if not section or 2 * sum(section) != rotated:
        raise ConvertError(f"text_config mrope_section {section} does not cover the {rotated} rotated dimensions of "
                           f"the head", "use the config.json saved with the model")
    return cfg.replace(position=replace(cfg.position, kind="mrope", mrope_section=tuple(int(s) for s in section),
                                        mrope_interleaved=interleaved))


def write_mrope(text: dict[str, Any], cfg: ModelConfig) -> None:
    """The model's multimodal RoPE into the text config's ``rope_parameters`` (transformers 5's spelling)."""
    if "rope_parameters" not in text:
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": text.pop("rope_theta")}
    text.pop("rope_scaling", None)
    text["rope_parameters"]["mrope_section"] = list(cfg.position.mrope_section or ())
    if cfg.position.mrope_interleaved:
        text["rope_parameters"]["mrope_interleaved"] = True


@dataclass(frozen=True, kw_only=True)
class VisionLanguage(Family):
    architecture: str
    model_type: str
    text: Family  # the language model's family

    # -- what a family adds ---------------------------------------------------------------------------------
    @abstractmethod
    def lm_name(self, name: str) -> str:
        """The HF name of the text family's tensor ``name`` in this model."""

    @abstractmethod
    def with_vision(self, cfg: ModelConfig, hf: dict[str, Any], text: dict[str, Any]) -> ModelConfig:
        """The text model ``cfg`` with the vision record (and what the vision component changes in it)."""

    @abstractmethod
    def vision_to_hf(self, hf: dict[str, Any], text: dict[str, Any], vision: dict[str, Any], cfg: ModelConfig) -> None:
        """Write the vision record (and what goes with it) into config.json, its text and vision configs."""

    @abstractmethod
    def vision_expresses(self) -> dict[str, Allowed]:
        """What the family writes of the vision record (and of the text model beyond its text family)."""

    def text_model(self, cfg: ModelConfig) -> ModelConfig:
        """The language model alone, as its text family writes it."""
        return cfg.replace(vision=None, position=replace(cfg.position, kind="rope", mrope_section=None,
                                                         mrope_interleaved=False))

    # -- Family ------------------------------------------------------------------------------------------------
    @property
    def hf_layers(self) -> str:  # type: ignore[override]
        return self.lm_name(self.text.hf_layers)

    @property
    def shifts(self) -> dict[str, float]:  # type: ignore[override]
        return self.text.shifts

    @property
    def hf_keys(self) -> frozenset[str]:
        """The text family's (applied to ``text_config``, where transformers reads them), and MRoPE's."""
        return self.text.hf_keys | MROPE_KEYS

    def text_model_type(self, hf: dict[str, Any]) -> str:
        """The ``model_type`` of the text config class transformers reads ``text_config`` with."""
        text = hf.get("text_config")
        return str((text or {}).get("model_type") or f"{self.model_type}_text")

    def from_hf(self, hf: dict[str, Any], vocab_divisible_by: int | None) -> Imported:
        text = self.text_config(hf)
        left = unmapped(text, self.hf_keys)
        if left:
            shown = ", ".join(f"text_config.{k}={v!r}" for k, v in left[:4])
            raise ConvertError(f"config.json sets {shown}, which changes what {self.architecture} computes and "
                               "which megatron-core's model here does not express",
                               "convert a config without it (dist_convert never drops a setting that changes the math)")
        # Megatron-Bridge keeps these models' vocabulary unpadded (should_pad_vocab False): pad only where TP needs it
        # an absent key as the text config class gives it (hf_keys.as_transformers_reads: Qwen3-VL's text RoPE base
        # is 5e5 where Qwen3's is 1e4)
        text = as_transformers_reads(text, self.text_model_type(hf))
        imported = self.text.from_hf(text, vocab_divisible_by or UNPADDED)
        return Imported(cfg=self.with_vision(imported.cfg, hf, text), notes=imported.notes)

    def text_config(self, hf: dict[str, Any]) -> dict[str, Any]:
        """config.json's language model as its text family reads it."""
        return text_of(hf)

    def to_hf(self, cfg: ModelConfig, base: dict[str, Any] | None, dtype: torch.dtype) -> dict[str, Any]:
        hf, same = base_config(self, base)
        kept = hf.get("text_config", {}) if same else {}
        text = self.text.to_hf(self.text_model(cfg), {**kept, "architectures": [self.text.architecture]}
                               if same else None, dtype)
        # transformers 5 writes dtype at the top; keys the nested config did not have stay out, those it had (its own
        # tie flag, unread: the top-level one ties) stay as it wrote them
        for key in ("architectures", "torch_dtype", "norm_topk_prob", "dtype", "tie_word_embeddings"):
            if key not in kept or key == "architectures":
                text.pop(key, None)
        if "tie_word_embeddings" in kept:
            text["tie_word_embeddings"] = kept["tie_word_embeddings"]
        if same and "head_dim" not in kept and text.get("head_dim") == cfg.hidden_size // cfg.num_attention_heads:
            text.pop("head_dim")  # what transformers derives
        text["model_type"] = kept.get("model_type", f"{self.model_type}_text")
        vision = copy.deepcopy(hf.get("vision_config", {})) if same else {}
        self.vision_to_hf(hf, text, vision, cfg)
        hf.update(architectures=[self.architecture], model_type=self.model_type, text_config=text,
                  vision_config=vision, tie_word_embeddings=cfg.tied, dtype=DTYPE_NAMES.get(dtype, "float32"))
        return hf

    def expresses(self) -> Mapping[str, Allowed]:
        return {**self.text.expresses(), "vision": {True}, **self.vision_expresses()}

    def layer_names(self, cfg: ModelConfig, stack: str, layer: int) -> list[Row]:
        return self.text.layer_names(cfg, stack, layer)

    def top_names(self, cfg: ModelConfig) -> tuple[tuple[str, str], ...]:
        return tuple((self.lm_name(h), lg) for h, lg in self.text.top_names(cfg))

    def optional_sets(self, cfg: ModelConfig) -> dict[str, tuple[list[str], bool]]:
        return {k: ([self.lm_name(n) for n in names], default)
                for k, (names, default) in self.text.optional_sets(cfg).items()}


def unscaled_rope(expresses: Mapping[str, Allowed]) -> dict[str, Allowed]:
    """A text family's declaration under multimodal RoPE, which is unscaled here: no YaRN, no frequency scaling."""
    return {**{k: v for k, v in expresses.items() if not k.startswith("position.scaling.")}, "position.scaling": {None}}


def token_expresses(fields: Collection[str]) -> dict[str, Allowed]:
    """Every token-id field the family writes: any value; the others only unset."""
    return {f"vision.{f}": ANY for f in fields}


V = TypeVar("V", bound=Vision)


def vision_record(tower: type[V], **kw: Any) -> V:
    """The record of a ``tower`` (one of ``features.vision.TOWERS``), its heads checked against its width."""
    v = tower(**kw)
    if v.heads and v.hidden % v.heads:
        raise ConvertError(f"vision_config: hidden_size {v.hidden} does not split into {v.heads} heads",
                           "use the config.json saved with the model")
    return v
