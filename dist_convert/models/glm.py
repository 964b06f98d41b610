"""GLM-4.5 / 4.6 / 4.7 (``Glm4MoeForCausalLM``): GQA attention (q/k/v biases with ``attention_bias``, never on
o_proj; per-head q/k RMSNorm with ``use_qk_norm``), partial RoPE (GPT-NeoX rotate-half on the first
``partial_rotary_factor`` of each head: megatron-core's ``rotary_percent``), and DeepSeek-V3's MoE and MTP layers:
dense first layers, sigmoid routing with ``e_score_correction_bias`` (megatron-core's fp32 ``router.expert_bias``),
group-limited, renormalised and scaled top-k, an ungated shared expert, and MTP layer k stored as decoder layer
``num_hidden_layers + k`` (``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``; GLM-4.5 releases store the
output head copy ``shared_head.head``, later ones neither copy: each set of copies is optional, and a round trip
gives back the source's own, ``Family.optional_sets``).

The MoE, the router and the MTP layers are DeepSeek's (``models/deepseek.py``); this module adds the GQA
attention, the partial RoPE and what transformers' Glm4Moe computes differently from megatron-core.
"""
from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..config import ModelConfig
from ..errors import ConvertError
from ..features import MTP
from .base import ANY, ATTENTION, Allowed, Family, Imported, get, require_int
from .deepseek import (
    MOE_HF_KEYS,
    drop_absent_mtp,
    moe_expresses,
    moe_from_hf,
    moe_to_hf,
    mtp_copies,
    mtp_optional_sets,
    stack_names,
)
from .llama import GQA_HF_KEYS, gqa_expresses, gqa_import, gqa_to_hf
from .rows import Row

NAME = "GLM-4.5"
PARTIAL_ROTARY_DEFAULT = 0.5  # transformers' Glm4MoeConfig default when config.json states none
# transformers' Glm4MoeConfig defaults for keys a config.json may leave out
DEFAULTS = {"rms_norm_eps": 1e-5, "max_position_embeddings": 131072}
MTP_DEFAULT = 1  # Glm4MoeConfig's num_mtp_layers (written as num_nextn_predict_layers)


@dataclass(frozen=True, kw_only=True)
class Glm4Moe(Family):
    architecture: str = "Glm4MoeForCausalLM"
    model_type: str = "glm4_moe"

    # -- config.json <-> model ---------------------------------------------------------------------------
    def from_hf(self, hf: dict[str, Any], vocab_divisible_by: int | None) -> Imported:
        hf = {**{k: v for k, v in DEFAULTS.items() if hf.get(k) is None}, **{k: v for k, v in hf.items()
                                                                              if v is not None}}
        layers = require_int(hf, "num_hidden_layers")
        experts = int(get(hf, "n_routed_experts", 0))
        dense = int(get(hf, "first_k_dense_replace", 1))
        if dense < layers:  # transformers builds an MoE MLP (routed + shared experts) for every later layer
            if experts < 1:
                raise ConvertError(f"n_routed_experts={experts} with MoE layers from layer {dense} on",
                                   "fix n_routed_experts in config.json")
            if int(get(hf, "n_shared_experts", 0)) < 1:
                raise ConvertError("n_shared_experts=0: transformers' Glm4Moe then stores an empty shared expert, "
                                   "which megatron-core has no module for", "convert a config with n_shared_experts "
                                   ">= 1 (as GLM releases have)")
            if int(get(hf, "num_experts_per_tok", 1)) == 1 and get(hf, "norm_topk_prob", True):
                raise ConvertError("num_experts_per_tok=1 with norm_topk_prob=true: GLM renormalises the chosen "
                                   "sigmoid score to 1, megatron-core keeps it", "convert a config with "
                                   "num_experts_per_tok > 1 (GLM releases route to 8 experts)")
        glm_moe = {k: v for k, v in hf.items() if k != "moe_layer_freq"}  # Glm4Moe has no moe_layer_freq
        glm_moe.update(first_k_dense_replace=dense, n_routed_experts=experts if dense < layers else 0)  # all dense
        moe = moe_from_hf(glm_moe, layers, require_int(hf, "intermediate_size"), True, NAME)
        mtp = require_int(hf, "num_nextn_predict_layers", "num_mtp_layers", default=MTP_DEFAULT)
        params = {**(hf.get("rope_parameters") or {})}
        if params.get("rope_type", "default") != "default" or hf.get("rope_scaling"):
            raise ConvertError(f"RoPE scaling {hf.get('rope_scaling') or params} of a GLM-4.5 model has no "
                               "megatron-core equivalent with partial RoPE",
                               "convert a config with rope_scaling null (GLM releases use plain RoPE)")
        cfg = gqa_import({**hf, "attention_bias": False}, vocab_divisible_by, NAME,
                         qkv_bias=bool(hf.get("attention_bias")), qk_norm=bool(hf.get("use_qk_norm")),
                         moe=moe, mtp=MTP(num_layers=mtp) if mtp else None, partial_default=PARTIAL_ROTARY_DEFAULT)
        return Imported(cfg=cfg, notes=[])

    @property
    def hf_keys(self) -> frozenset[str]:
        return GQA_HF_KEYS | MOE_HF_KEYS | {"use_qk_norm", "rope.partial_rotary_factor"}

    def to_hf(self, cfg: ModelConfig, base: dict[str, Any] | None, dtype: torch.dtype) -> dict[str, Any]:
        hf, _ = gqa_to_hf(self, cfg, base, dtype, partial_default=PARTIAL_ROTARY_DEFAULT)
        hf.update(moe_to_hf(cfg))
        hf.update(attention_bias=cfg.add_qkv_bias, use_qk_norm=cfg.attention.qk_norm,
                  num_nextn_predict_layers=cfg.mtp_num_layers, partial_rotary_factor=cfg.position.percent)
        if isinstance(hf.get("rope_parameters"), dict):  # transformers 5 reads the factor from here first
            hf["rope_parameters"] = {**hf["rope_parameters"], "partial_rotary_factor": cfg.position.percent}
        hf.pop("moe_layer_freq", None)
        return hf

    def expresses(self) -> Mapping[str, Allowed]:
        """GQA attention with or without q/k/v biases and q/k norms, plain partial RoPE, DeepSeek-V3's MoE with a
        shared expert and top-k > 1, MTP layers."""
        return {**gqa_expresses(qkv_bias=None, qk_norm=True), "attention.qk_norm": ANY, "position.kind": {"rope"},
                "position.scaling": {None}, "position.percent": ANY, "moe": {True}, "mtp": {True, False},
                **moe_expresses(True), "moe.shared_size": lambda v, cfg: bool(v) and v % cfg.expert_ffn == 0}

    # -- names --------------------------------------------------------------------------------------------
    def layer_names(self, cfg: ModelConfig, stack: str, layer: int) -> list[Row]:
        return stack_names(cfg, stack, layer, ATTENTION)

    def as_stored(self, cfg: ModelConfig, found: Collection[str], notes: list[str]) -> ModelConfig:
        return drop_absent_mtp(cfg, found, notes)

    def stored_copies(self, cfg: ModelConfig, found: Collection[str]) -> dict[str, list[str]]:
        return mtp_copies(cfg, found)

    def optional_sets(self, cfg: ModelConfig) -> dict[str, tuple[list[str], bool]]:
        return {**super().optional_sets(cfg), **mtp_optional_sets(cfg)}


FAMILIES = (Glm4Moe(),)
