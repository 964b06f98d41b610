"""Mixtral, Qwen2-MoE and Qwen3-MoE (``*ForCausalLM``): Llama-shaped attention with Mixture-of-Experts MLPs
(a softmax router; Qwen2-MoE adds a sigmoid-gated shared expert; the Qwen families may keep dense layers
between MoE layers). transformers >= 5 may store all experts of a layer in one tensor
(``save_original_format=False``): read as an alternative layout (``alternatives``)."""
from __future__ import annotations

import argparse
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..config import ModelConfig
from ..errors import ConvertError
from ..layout.boxes import Box, Piece
from ..layout.rules import LAYER_PREFIX, logical_tensors
from .base import (
    ATTENTION_NAMES,
    DENSE_MLP,
    EXPERT_FC1,
    EXPERT_FC2,
    EXPORT_FIX,
    MLP_NORM,
    Family,
    HFTensors,
    Imported,
    Name,
    expert_names,
    in_layer,
    layer_prefix,
    require_int,
    structure_problems,
)
from .llama import attention_problems, gqa_import, gqa_to_hf

SHARED_NAMES: tuple[Name, ...] = (
    ("mlp.shared_expert.gate_proj.weight", "mlp.shared_experts.linear_fc1.weight", "gate"),
    ("mlp.shared_expert.up_proj.weight", "mlp.shared_experts.linear_fc1.weight", "up"),
    ("mlp.shared_expert.down_proj.weight", "mlp.shared_experts.linear_fc2.weight", None),
    ("mlp.shared_expert_gate.weight", "mlp.shared_experts.gate_weight", None),
)
# transformers >= 5 with save_original_format=False: all experts of a layer in one tensor, leading axis = expert
FUSED_FC1, FUSED_FC2, FUSED_ROUTER = "mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"


def hf_moe_pattern(layers: int, sparse_step: int, mlp_only: list[int]) -> tuple[int, ...]:
    """Pure: Qwen-MoE's rule, 1 per MoE layer: ``l not in mlp_only_layers and (l + 1) % decoder_sparse_step == 0``."""
    if sparse_step < 1:
        raise ConvertError(f"decoder_sparse_step={sparse_step} is not a positive layer step",
                           "fix decoder_sparse_step in config.json (1: every layer is MoE)")
    skip = set(mlp_only)
    return tuple(int(l not in skip and (l + 1) % sparse_step == 0) for l in range(layers))


@dataclass(frozen=True, kw_only=True)
class MoE(Family):
    architecture: str
    model_type: str
    qkv_bias: bool = False
    qk_norm: bool = False
    block: str = "mlp"  # module of an MoE layer on disk (Mixtral: block_sparse_moe)
    expert_proj: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # per expert: gate, up, down
    shared_expert: bool = False  # every MoE layer has a sigmoid-gated shared expert (Qwen2-MoE)
    dense_layers: bool = True  # dense MLP layers may sit between MoE layers (Qwen); Mixtral: every layer MoE
    qkv_bias_flag: bool = False  # config.json's "qkv_bias" switches the q/k/v biases (Qwen2-MoE)
    scope: ClassVar[str] = "none of the supported Hugging Face MoE families (MixtralForCausalLM, " \
                           "Qwen2MoeForCausalLM, Qwen3MoeForCausalLM)"

    # -- config.json <-> model ---------------------------------------------------------------------------
    def from_hf(self, hf: dict[str, Any], vocab_divisible_by: int | None) -> Imported:
        layers = require_int(hf, "num_hidden_layers")
        notes: list[str] = []
        model, args = self._moe_from_hf(hf, layers, notes)
        qkv_bias = bool(hf.get("qkv_bias", self.qkv_bias)) if self.qkv_bias_flag else self.qkv_bias
        _, cfg, ns, more = gqa_import(hf, vocab_divisible_by, qkv_bias=qkv_bias, qk_norm=self.qk_norm,
                                      sliding_default=self.model_type == "mixtral", model=model, args=args)
        return Imported(cfg=cfg, args=ns, notes=more + notes)

    def _moe_from_hf(self, hf: dict[str, Any], layers: int, notes: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
        experts = require_int(hf, "num_local_experts", "num_experts")
        topk = require_int(hf, "num_experts_per_tok", default=2)
        if self.dense_layers:  # Qwen-MoE: experts of moe_intermediate_size, dense layers of intermediate_size
            expert_ffn = require_int(hf, "moe_intermediate_size")
            pattern: tuple[int, ...] | None = hf_moe_pattern(
                layers, require_int(hf, "decoder_sparse_step", default=1), list(hf.get("mlp_only_layers") or []))
            if all(pattern):
                pattern = None
            pre_softmax = not bool(hf.get("norm_topk_prob", False))
        else:  # Mixtral: every layer MoE, experts of intermediate_size, top-k renormalised
            expert_ffn, pattern, pre_softmax = int(hf["intermediate_size"]), None, False
            if float(hf.get("router_jitter_noise") or 0.0):
                notes.append(f"router_jitter_noise={hf['router_jitter_noise']} (training-time noise) has no "
                             "Megatron-LM argument; it is kept only in the origin's config.json")
        shared = require_int(hf, "shared_expert_intermediate_size", default=0) if self.shared_expert else 0
        model = {"num_experts": experts, "moe_ffn_hidden_size": expert_ffn, "moe_layer_pattern": pattern,
                 "moe_shared_expert_intermediate_size": shared or None, "moe_shared_expert_gate": bool(shared)}
        args = {"num_experts": experts, "moe_ffn_hidden_size": expert_ffn,
                "moe_shared_expert_intermediate_size": shared or None, "moe_shared_expert_gate": bool(shared),
                "moe_layer_freq": 1 if pattern is None else list(pattern), "moe_router_topk": topk,
                "moe_router_pre_softmax": pre_softmax, "moe_router_score_function": "softmax",
                "moe_router_enable_expert_bias": False, "moe_grouped_gemm": False,
                "expert_model_parallel_size": 1, "expert_tensor_parallel_size": 1}
        return model, args

    def to_hf(self, cfg: ModelConfig, args: argparse.Namespace, base: dict[str, Any] | None,
              dtype: torch.dtype) -> dict[str, Any]:
        hf, same = gqa_to_hf(self, cfg, args, base, dtype)
        hf.update(self._moe_to_hf(cfg, args, hf if same else {}))
        return hf

    def _moe_to_hf(self, cfg: ModelConfig, args: argparse.Namespace, base: dict[str, Any]) -> dict[str, Any]:
        """The MoE keys of ``config.json`` (``base``: the same family's original config, or empty)."""
        topk = int(getattr(args, "moe_router_topk", None) or base.get("num_experts_per_tok") or 2)
        # the router maths is not in the tensors: refuse what the family would compute differently
        if (getattr(args, "moe_router_score_function", None) or "softmax") != "softmax":
            raise ConvertError(f"the MoE router scores with {args.moe_router_score_function}; {self.architecture} "
                               "uses softmax", EXPORT_FIX)
        if not self.dense_layers and getattr(args, "moe_router_pre_softmax", False):
            raise ConvertError(f"the MoE router takes the softmax before top-k without renormalising "
                               f"(moe_router_pre_softmax); {self.architecture} renormalises the top-k", EXPORT_FIX)
        if not self.dense_layers:  # Mixtral: experts of intermediate_size
            return {"num_local_experts": cfg.num_experts, "num_experts_per_tok": topk,
                    "intermediate_size": cfg.expert_ffn}
        pattern = cfg.moe_layer_pattern or (1,) * cfg.num_layers
        step, only = base.get("decoder_sparse_step", 1), base.get("mlp_only_layers") or []
        if not (isinstance(step, int) and step >= 1 and hf_moe_pattern(cfg.num_layers, step, list(only)) == pattern):
            step, only = 1, [layer for layer, moe in enumerate(pattern) if not moe]
        pre_softmax = getattr(args, "moe_router_pre_softmax", None)
        out: dict[str, Any] = {
            "num_local_experts" if "num_local_experts" in base else "num_experts": cfg.num_experts,
            "num_experts_per_tok": topk, "moe_intermediate_size": cfg.expert_ffn, "decoder_sparse_step": step,
            "mlp_only_layers": list(only),
            "norm_topk_prob": bool(base.get("norm_topk_prob", False)) if pre_softmax is None else not pre_softmax}
        if self.shared_expert:
            out["shared_expert_intermediate_size"] = cfg.moe_shared_expert_intermediate_size
        if self.qkv_bias_flag:
            out["qkv_bias"] = cfg.add_qkv_bias
        return out

    def affinity(self, cfg: ModelConfig) -> int:
        """Shared experts: Qwen2-MoE; q/k layernorm: Qwen3-MoE; else Mixtral."""
        if not cfg.num_experts or cfg.mla:
            return 0
        if cfg.moe_shared_expert_intermediate_size:
            return 3 if self.shared_expert else 1
        if cfg.qk_layernorm:
            return 3 if self.qk_norm else 1
        return 2 if not self.dense_layers else 1

    def why_not(self, cfg: ModelConfig, args: argparse.Namespace) -> str | None:
        problems = structure_problems(cfg) + attention_problems(
            cfg, qkv_bias=None if self.qkv_bias_flag else self.qkv_bias, qk_norm=self.qk_norm)
        if problems:
            return ", ".join(problems)
        return self.moe_problem(cfg)

    def moe_problem(self, cfg: ModelConfig) -> str | None:
        """What of the model's Mixture-of-Experts layers this family cannot express."""
        if not cfg.num_experts:
            return "no Mixture-of-Experts layers"
        shared = bool(cfg.moe_shared_expert_intermediate_size)
        if cfg.moe_router_expert_bias:
            return "a router expert bias (moe_router_enable_expert_bias)"
        if shared and not cfg.moe_shared_expert_gate:
            return "shared experts without a gate (moe_shared_expert_gate)"
        if shared != self.shared_expert:
            return "shared experts" if shared else "no shared experts"
        if cfg.moe_layer_pattern is not None and not self.dense_layers:
            return f"dense layers between the MoE layers (moe_layer_freq={list(cfg.moe_layer_pattern)})"
        return None

    def refusal(self, problem: str) -> ConvertError:
        if self.dense_layers or not problem.startswith("dense layers"):
            return super().refusal(problem)
        return ConvertError(f"the MoE model has {problem}, which {self.architecture} (no dense layers; Qwen2-MoE "
                            "needs gated shared experts and Qwen3-MoE q/k layernorm, which the model lacks) can "
                            "express", EXPORT_FIX)

    # -- names --------------------------------------------------------------------------------------------
    def layer_names(self, cfg: ModelConfig, stack: str, layer: int) -> list[Name]:
        names: list[Name] = list(ATTENTION_NAMES + MLP_NORM)
        if cfg.is_moe_layer(layer):
            names += [(f"{self.block}.gate.weight", "mlp.router.weight", None)]
            names += expert_names(self.block, cfg.num_experts, self.expert_proj)
            names += SHARED_NAMES if self.shared_expert else ()
        else:
            names += DENSE_MLP
        return in_layer(names, layer_prefix(stack, layer))

    def alternatives(self, cfg: ModelConfig, found: Collection[str], expected: HFTensors) -> HFTensors:
        """The fused expert tensors transformers >= 5 writes with ``save_original_format=False``
        (``mlp.experts.gate_up_proj`` (E, 2F, H), ``mlp.experts.down_proj`` (E, H, F), router ``mlp.gate``)
        present in ``found``. Expert e of a fused tensor is its box (e, :, :), the whole fc1 / fc2 of that expert."""
        out: HFTensors = {}
        logical = logical_tensors(cfg)
        for layer in range(cfg.num_layers):
            if not cfg.is_moe_layer(layer):
                continue
            hf, mc = f"model.layers.{layer}.", f"{LAYER_PREFIX}{layer}."
            for fused, per_expert in ((FUSED_FC1, EXPERT_FC1), (FUSED_FC2, EXPERT_FC2)):
                if hf + fused in found:
                    lshape = logical[mc + per_expert.format(e=0)].shape
                    shape = (cfg.num_experts,) + tuple(lshape)
                    out[hf + fused] = (shape, [Piece(mc + per_expert.format(e=e), Box.full(lshape),
                                                     Box((e,) + (0,) * len(lshape), (1,) + tuple(lshape)))
                                               for e in range(cfg.num_experts)])
            router = mc + "mlp.router.weight"
            if self.block != "mlp" and hf + FUSED_ROUTER in found:
                full = Box.full(logical[router].shape)
                out[hf + FUSED_ROUTER] = (logical[router].shape, [Piece(router, full, full)])
        return out


FAMILIES = (
    MoE(architecture="MixtralForCausalLM", model_type="mixtral", block="block_sparse_moe",
        expert_proj=("w1", "w3", "w2"), dense_layers=False),
    MoE(architecture="Qwen2MoeForCausalLM", model_type="qwen2_moe", qkv_bias=True, shared_expert=True,
        qkv_bias_flag=True),
    MoE(architecture="Qwen3MoeForCausalLM", model_type="qwen3_moe", qk_norm=True),
)
