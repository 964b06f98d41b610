"""Model families: one module each, registered here in one table.

A model is imported as the family its ``config.json`` names (``architectures``) and exported as the family
it came from when that family can express it, else as the family its own evidence points at
(``Family.affinity``: MLA -> DeepSeek, experts -> the MoE families, ...) that can. ``docs/adding_a_family.md``
walks through adding one.
"""
from __future__ import annotations

import argparse
from typing import Any

import torch

from ..config import ModelConfig
from ..errors import ConvertError
from . import deepseek, gemma3, glm, gpt_oss, llama, moe, nemotron_h, qwen3_next
from .base import Family, Imported

FAMILIES: dict[str, Family] = {f.architecture: f for f in (
    *llama.FAMILIES, *moe.FAMILIES, *deepseek.FAMILIES, *gemma3.FAMILIES, *glm.FAMILIES, *gpt_oss.FAMILIES,
    *nemotron_h.FAMILIES, *qwen3_next.FAMILIES)}
DEFAULT = FAMILIES["LlamaForCausalLM"]  # the nearest family of a model no family's evidence points at


def family_of(hf: dict[str, Any]) -> Family:
    """The family of an HF ``config.json`` (refused in one line when none is supported)."""
    archs = hf.get("architectures") or []
    for a in archs:
        if a in FAMILIES:
            return FAMILIES[a]
    raise ConvertError(f"unsupported Hugging Face architecture {archs or hf.get('model_type')!r}",
                       f"supported architectures: {', '.join(FAMILIES)}")


def family_of_or_none(hf: Any) -> Family | None:
    if not isinstance(hf, dict):
        return None
    try:
        return family_of(hf)
    except ConvertError:
        return None


def config_from_hf(hf: dict[str, Any], vocab_divisible_by: int | None) -> tuple[ModelConfig, argparse.Namespace,
                                                                                    list[str]]:
    """Model config, Megatron-LM args and notes for an HF ``config.json``."""
    imported: Imported = family_of(hf).from_hf(hf, vocab_divisible_by)
    return imported.cfg, imported.args, imported.notes


def export_family(cfg: ModelConfig, args: argparse.Namespace, base: dict[str, Any] | None = None) -> Family:
    """The HF family a megatron-core model exports as: the one it came from (``base``: the HF config.json it
    was imported from, its Origin's) when that one expresses it, else the first, by affinity, that does;
    refused in the nearest family's words when none does."""
    for a in (base or {}).get("architectures") or []:
        fam = FAMILIES.get(a)
        if fam is not None and fam.why_not(cfg, args) is None:
            return fam
    ranked = sorted((f for f in FAMILIES.values() if f.affinity(cfg) > 0), key=lambda f: -f.affinity(cfg))
    for fam in ranked:
        if fam.why_not(cfg, args) is None:
            return fam
    nearest = ranked[0] if ranked else DEFAULT
    raise nearest.refusal(nearest.why_not(cfg, args) or "no family")


def naming_family(cfg: ModelConfig) -> Family:
    """The family whose names a model's HF tensors take when no family was named: the one it exports as,
    or the nearest by affinity (names only; the router arguments it may refuse are not looked at)."""
    try:
        return export_family(cfg, argparse.Namespace())
    except ConvertError:
        ranked = sorted(FAMILIES.values(), key=lambda f: -f.affinity(cfg))
        return ranked[0]


def hf_from_config(cfg: ModelConfig, args: argparse.Namespace, dtype: torch.dtype,
                   base: dict[str, Any] | None = None) -> dict[str, Any]:
    """``config.json`` for the model: ``base`` (the HF config.json it was imported from, its Origin's),
    updated, when it is of the family the model exports as; else written from the model config and args."""
    base = base if isinstance(base, dict) else None
    fam = export_family(cfg, args, base)
    return fam.to_hf(cfg, args, base if family_of_or_none(base) is fam else None, dtype)
