"""Model families: one module each, every family registered here once, in one sequence that is the order of
preference (``REGISTERED``; ``FAMILIES`` and ``PREFERENCE`` are derived from it).

A model is imported as the family its ``config.json`` names (``architectures``); config.json keys that change the
math and that the family does not map are refused (``hf_keys.unmapped``). A model is exported as the family it
came from when that family expresses every setting of it (``Family.unexpressed``), else as the first family of
``PREFERENCE`` that does; refused in one line, in the nearest family's terms, when none does. Every export reads its
own config.json back and compares it with the model before anything is written. ``docs/adding_a_family.md`` walks
through adding one.
"""
from __future__ import annotations

import argparse
from typing import Any

import torch

from ..config import OPTIONAL, ModelConfig
from ..errors import ConvertError
from ..mlm_args import HF_TOKENIZER, model_args
from . import (
    deepseek,
    dsa,
    gemma3,
    gemma3_vl,
    glm,
    glm45v,
    gpt_oss,
    kimi_k25,
    llama,
    minimax,
    ministral3,
    moe,
    nemotron_h,
    qwen3_next,
    qwen3_vl,
    qwen25_vl,
)
from .base import EXPORT_FIX, Family, Imported, hf_dtype
from .hf_keys import as_transformers_reads, unmapped

# Every family, registered once, in the order of preference: the order a model without an origin of its own tries
# them in; the first that expresses it exports it. Families rarely overlap (each expresses what its config.json can
# say): the order decides only between those that both can, e.g. Llama before Mistral for a model without a window,
# Mixtral before the Qwen MoE families. A module's FAMILIES are in its own order of preference.
REGISTERED: tuple[Family, ...] = (
    *llama.FAMILIES,  # Llama, Qwen2, Qwen3, Mistral
    *gemma3.FAMILIES,
    *moe.FAMILIES,  # Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE
    *minimax.FAMILIES,  # MiniMax-M2
    *glm.FAMILIES,
    *deepseek.FAMILIES,  # DeepSeek-V3, V2
    *dsa.FAMILIES,  # GLM-4.7-Flash, DeepSeek-V3.2, GLM-5
    *gpt_oss.FAMILIES,
    *nemotron_h.FAMILIES,
    *qwen3_next.FAMILIES,  # Qwen3-Next, Qwen3.5, Qwen3.5-MoE
    *qwen3_vl.FAMILIES,
    *qwen25_vl.FAMILIES,
    *gemma3_vl.FAMILIES,
    *glm45v.FAMILIES,
    *ministral3.FAMILIES,  # Ministral 3, and with images (Mistral 3)
    *kimi_k25.FAMILIES,  # Kimi-K2.5 with images
)
# Families people convert that megatron-core 0.19.2 and Megatron-Bridge 0.6.2 cannot build, by config.json
# ``model_type``: refused in one line naming what is missing (docs/families.md lists them). DeepSeek-V4: transformers
# 5.14's deepseek_v4; Bridge 0.6.2's deepseek_v4_bridge.py needs megatron-core modules 0.19.2 does not have
# (HyperConnectionModule, CompressedSparseAttention / CSAIndexer, hash-routing tid2eid). GLM-5.3 and Kimi-Linear: the
# releases' config.json (remote code); no megatron-core release has Kimi delta attention.
UNBUILDABLE: dict[str, tuple[str, str]] = {
    "deepseek_v4": ("DeepSeek-V4", "compressed sparse / heavily compressed attention (CSA / HCA), hyper-connections "
                                   "and hash routing (Megatron-LM's dev branch only)"),
    "glm5_next": ("GLM-5.3", "Kimi delta attention (KDA) linear-attention layers and a pooled sparse-attention "
                             "indexer"),
    "kimi_linear": ("Kimi-Linear", "Kimi delta attention (KDA) linear-attention layers"),
}
FAMILIES: dict[str, Family] = {f.architecture: f for f in REGISTERED}  # architecture -> family, in PREFERENCE order
PREFERENCE: tuple[str, ...] = tuple(FAMILIES)


def family_of(hf: dict[str, Any]) -> Family:
    """The family of an HF ``config.json`` (refused in one line when none is supported)."""
    archs = hf.get("architectures") or []
    for a in archs:
        if a in FAMILIES:
            return FAMILIES[a]
    if hf.get("model_type") in UNBUILDABLE:
        name, missing = UNBUILDABLE[hf["model_type"]]
        raise ConvertError(f"{name} ({archs[0] if archs else hf['model_type']}) has {missing}, which neither "
                           "megatron-core 0.19.2 nor Megatron-Bridge 0.6.2 builds", "nothing here converts it yet; "
                           "keep the Hugging Face checkpoint (docs/families.md lists what converts)")
    raise ConvertError(f"unsupported Hugging Face architecture {archs or hf.get('model_type')!r}",
                       f"supported architectures: {', '.join(FAMILIES)}")


def family_of_or_none(hf: Any) -> Family | None:
    if not isinstance(hf, dict):
        return None
    try:
        return family_of(hf)
    except ConvertError:
        return None


def import_config(hf: dict[str, Any], vocab_divisible_by: int | None) -> Imported:
    """The model config and notes of an HF ``config.json``: its family's reading, after refusing every key that
    changes the math and that the family does not map."""
    fam = family_of(hf)
    left = unmapped(hf, fam.hf_keys)
    if left:
        shown = ", ".join(f"{k}={v!r}" for k, v in left[:4])
        raise ConvertError(f"config.json sets {shown}, which changes what {fam.architecture} computes and which "
                           "megatron-core's model here does not express",
                           "convert a config without it (dist_convert never drops a setting that changes the math)")
    return fam.from_hf(as_transformers_reads(hf, fam.model_type), vocab_divisible_by)


def config_from_hf(hf: dict[str, Any], vocab_divisible_by: int | None) -> tuple[ModelConfig, argparse.Namespace,
                                                                                    list[str]]:
    """Model config, its Megatron-LM args (written from the config's records) and notes for an HF ``config.json``."""
    imported = import_config(hf, vocab_divisible_by)
    return imported.cfg, model_args(imported.cfg, hf_dtype(hf), tokenizer_type=HF_TOKENIZER), imported.notes


def expressing_family(cfg: ModelConfig, base: dict[str, Any] | None = None) -> Family | None:
    """The family the model came from (``base``: its HF config.json) when that one expresses it, else the first of
    ``PREFERENCE`` that does; None when none does."""
    origin = [FAMILIES[a] for a in (base or {}).get("architectures") or [] if a in FAMILIES]
    return next((fam for fam in origin + [FAMILIES[a] for a in PREFERENCE] if not fam.unexpressed(cfg)), None)


def export_family(cfg: ModelConfig, base: dict[str, Any] | None = None) -> Family:
    """The HF family a megatron-core model exports as: the one it came from (``base``: the HF config.json it
    was imported from, its Origin's) when that one expresses it, else the first of ``PREFERENCE`` that does;
    refused in the nearest family's words when none does."""
    fam = expressing_family(cfg, base)
    if fam is None:
        nearest = nearest_family(cfg)
        raise nearest.refusal(nearest.unexpressed(cfg))
    return fam


def nearest_family(cfg: ModelConfig) -> Family:
    """The family nearest the model: the fewest features (MoE, MLA, ...) it lacks or adds, then the fewest other
    settings it cannot write, then ``PREFERENCE``."""
    def distance(fam: Family) -> tuple[int, int]:
        problems = fam.unexpressed(cfg)
        structural = sum(1 for s in problems if s.key in OPTIONAL)
        return structural, len(problems) - structural

    return min((FAMILIES[a] for a in PREFERENCE), key=distance)


def naming_family(cfg: ModelConfig) -> Family:
    """The family whose names a model's HF tensors take: the one it exports as, or the nearest."""
    return expressing_family(cfg) or nearest_family(cfg)


def hf_from_config(cfg: ModelConfig, dtype: torch.dtype, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """``config.json`` for the model: ``base`` (the HF config.json it was imported from, its Origin's),
    updated, when it is of the family the model exports as; else written from the model config. Read back by the
    family and compared with the model, setting by setting, before it is returned."""
    base = base if isinstance(base, dict) else None
    fam = export_family(cfg, base)
    out = fam.to_hf(cfg, base if family_of_or_none(base) is fam else None, dtype)
    differ = cfg.differences(fam.from_hf(out, cfg.make_vocab_size_divisible_by).cfg)
    if differ:
        raise ConvertError(f"the {fam.architecture} config.json written for this model reads back as another model "
                           f"({'; '.join(differ[:3])})", f"a dist_convert bug: please report it; {EXPORT_FIX}")
    return out
