"""GLM-4.5 / 4.6 / 4.7 (``Glm4MoeForCausalLM``): GQA attention (q/k/v biases with ``attention_bias``, never on
o_proj; per-head q/k RMSNorm with ``use_qk_norm``), partial RoPE (GPT-NeoX rotate-half on the first
``partial_rotary_factor`` of each head: megatron-core's ``rotary_percent``, carried in the Megatron-LM args),
and DeepSeek-V3's MoE and MTP layers: dense first layers, sigmoid routing with ``e_score_correction_bias``
(megatron-core's fp32 ``router.expert_bias``), group-limited, renormalised and scaled top-k, an ungated
shared expert, and MTP layer k stored as decoder layer ``num_hidden_layers + k`` (``enorm``, ``hnorm``,
``eh_proj``, ``shared_head.norm``; GLM-4.5 releases store the output head copy ``shared_head.head``, later
ones neither copy: both are optional on read and written on export, as DeepSeek-V3 releases have them).

The MoE, the router and the MTP layers are DeepSeek's (``models/deepseek.py``); this module adds the GQA
attention, the partial RoPE and what transformers' Glm4Moe computes differently from megatron-core.
"""
from __future__ import annotations

import argparse
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..config import ModelConfig
from ..errors import ConvertError
from .base import (
    ATTENTION_NAMES,
    EXPORT_FIX,
    Family,
    HFTensors,
    Imported,
    Name,
    get,
    require_int,
    rope_of,
    structure_problems,
)
from .deepseek import (
    MTP_COPIES,
    drop_absent_mtp,
    moe_from_hf,
    moe_problems,
    moe_to_hf,
    mtp_copies,
    stack_names,
)
from .llama import attention_problems, gqa_import, gqa_to_hf

NAME = "GLM-4.5"
PARTIAL_ROTARY_DEFAULT = 0.5  # transformers' Glm4MoeConfig default when config.json states none
# transformers' Glm4MoeConfig defaults for keys a config.json may leave out
DEFAULTS = {"rms_norm_eps": 1e-5, "max_position_embeddings": 131072}
MTP_DEFAULT = 1  # Glm4MoeConfig's num_mtp_layers (written as num_nextn_predict_layers)


def partial_rotary_factor(hf: dict[str, Any]) -> float:
    """The rotated share of each head, as transformers reads it (``rope_parameters`` first, then the top level)."""
    params = hf.get("rope_parameters") or {}
    value = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    return PARTIAL_ROTARY_DEFAULT if value is None else float(value)


def router_problems(cfg: ModelConfig, args: argparse.Namespace) -> list[str]:
    """What of a sigmoid router with an expert bias transformers' Glm4Moe router computes differently."""
    problems = []
    if not cfg.moe_router_expert_bias:
        problems.append("no router expert bias (GLM routes with sigmoid scores and e_score_correction_bias)")
    if not cfg.moe_shared_expert_intermediate_size:
        problems.append("no shared expert (every GLM MoE layer has n_shared_experts >= 1)")
    topk = int(getattr(args, "moe_router_topk", None) or 2)
    if topk == 1:
        problems.append("top-1 sigmoid routing (megatron-core keeps the chosen score, GLM renormalises it to 1)")
    groups, group_topk = getattr(args, "moe_router_num_groups", None), getattr(args, "moe_router_group_topk", None)
    if groups and int(groups) > 1 and (not group_topk or topk % int(group_topk) or topk // int(group_topk) != 2):
        problems.append(f"group-limited routing scoring a group by its top {topk}/{group_topk} experts "
                        "(GLM: by its top 2)")
    return problems


@dataclass(frozen=True, kw_only=True)
class Glm4Moe(Family):
    architecture: str = "Glm4MoeForCausalLM"
    model_type: str = "glm4_moe"
    scope: ClassVar[str] = "Glm4MoeForCausalLM (GLM-4.5 / 4.6 / 4.7)"

    # -- config.json <-> model ---------------------------------------------------------------------------
    def from_hf(self, hf: dict[str, Any], vocab_divisible_by: int | None) -> Imported:
        hf = {**{k: v for k, v in DEFAULTS.items() if hf.get(k) is None}, **{k: v for k, v in hf.items()
                                                                              if v is not None}}
        layers = require_int(hf, "num_hidden_layers")
        _, scaling = rope_of(hf)
        if scaling:
            raise ConvertError(f"RoPE scaling {scaling} of a GLM-4.5 model has no megatron-core equivalent with "
                               "partial RoPE", "convert a config with rope_scaling null (GLM releases use plain RoPE)")
        rotary = partial_rotary_factor(hf)
        if not 0.0 < rotary <= 1.0:
            raise ConvertError(f"partial_rotary_factor={rotary} is not a share of the head",
                               "fix partial_rotary_factor in config.json (0 < factor <= 1; GLM releases have 0.5)")
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
        moe_cfg, moe_args = moe_from_hf(glm_moe, layers, require_int(hf, "intermediate_size"), True, NAME)
        mtp = require_int(hf, "num_nextn_predict_layers", "num_mtp_layers", default=MTP_DEFAULT)
        _, cfg, args, notes = gqa_import(
            {**hf, "attention_bias": False}, vocab_divisible_by, qkv_bias=bool(hf.get("attention_bias")),
            qk_norm=bool(hf.get("use_qk_norm")), sliding_default=False, model={**moe_cfg, "mtp_num_layers": mtp},
            args={**moe_args, "mtp_num_layers": mtp or None})
        args.rotary_percent = rotary
        return Imported(cfg=cfg, args=args, notes=notes)

    def to_hf(self, cfg: ModelConfig, args: argparse.Namespace, base: dict[str, Any] | None,
              dtype: torch.dtype) -> dict[str, Any]:
        hf, _ = gqa_to_hf(self, cfg, args, base, dtype)
        rotary = float(getattr(args, "rotary_percent", None) or 1.0)
        hf.update(moe_to_hf(cfg, args) if cfg.num_experts else {})
        hf.update(attention_bias=cfg.add_qkv_bias, use_qk_norm=cfg.qk_layernorm, norm_topk_prob=True,
                  num_nextn_predict_layers=cfg.mtp_num_layers, partial_rotary_factor=rotary)
        hf.pop("moe_layer_freq", None)
        if isinstance(hf.get("rope_parameters"), dict):  # transformers 5 reads the factor from here first
            hf["rope_parameters"] = {**hf["rope_parameters"], "partial_rotary_factor": rotary}
        return hf

    def affinity(self, cfg: ModelConfig) -> int:
        """DeepSeek's MoE (sigmoid router with an expert bias) or MTP layers over GQA attention; less with a gated
        shared expert (Qwen2-MoE's, the nearer family then)."""
        if not cfg.num_experts or cfg.mla or not (cfg.moe_router_expert_bias or cfg.mtp_num_layers):
            return 0
        return 2 if cfg.moe_shared_expert_gate else 4

    def why_not(self, cfg: ModelConfig, args: argparse.Namespace) -> str | None:
        problems = structure_problems(cfg, gqa_mtp=True) + attention_problems(cfg, qkv_bias=None,
                                                                              qk_norm=cfg.qk_layernorm)
        if not cfg.num_experts:
            problems.append("no Mixture-of-Experts layers")
        else:
            problems += moe_problems(cfg, args) + router_problems(cfg, args)
        if getattr(args, "use_rope_scaling", False):
            problems.append("Llama-3 RoPE scaling")
        if getattr(args, "rotary_interleaved", False):
            problems.append("interleaved RoPE (GLM rotates halves)")
        return "; ".join(problems) or None

    def refusal(self, problem: str) -> ConvertError:
        return ConvertError(f"the model has {problem}, which {self.scope} cannot express", EXPORT_FIX)

    # -- names --------------------------------------------------------------------------------------------
    def layer_names(self, cfg: ModelConfig, stack: str, layer: int) -> list[Name]:
        return stack_names(cfg, stack, layer, ATTENTION_NAMES)

    def as_stored(self, cfg: ModelConfig, args: argparse.Namespace, found: Collection[str],
                  notes: list[str]) -> ModelConfig:
        return drop_absent_mtp(cfg, args, found, notes)

    def stored_copies(self, cfg: ModelConfig, found: Collection[str]) -> dict[str, list[str]]:
        return mtp_copies(cfg, found)

    def alternatives(self, cfg: ModelConfig, found: Collection[str], expected: HFTensors) -> HFTensors:
        """A release without some of the MTP layers' embedding / head copies (GLM-4.6 and 4.7 store neither):
        the tensor they copy re-declared with the copies that are stored, so those absent are not expected."""
        copies = {f"model.layers.{cfg.num_layers + k}.{suffix}" for k in range(cfg.mtp_num_layers)
                  for suffix, _ in MTP_COPIES}
        absent = (copies & set(expected)) - set(found)
        copied = {p.logical for key in absent for p in expected[key][1]}
        return {key: (shape, pieces) for key, (shape, pieces) in expected.items()
                if {p.logical for p in pieces} <= copied and (key in found or key not in copies)}

FAMILIES = (Glm4Moe(),)
