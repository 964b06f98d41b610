"""Qwen3-Next (``Qwen3NextForCausalLM``) and Qwen3.5 (``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``): Gated
DeltaNet layers (linear attention) interleaved with gated full-attention layers (``layer_types``), norms computing
x * (1 + w), q/k norms, partial RoPE, and a SwiGLU MLP: MoE with a sigmoid-gated shared expert (Qwen3-Next,
Qwen3.5-MoE) or dense (Qwen3.5).

The Megatron side is megatron-core's GPTModel with ``experimental_attention_variant`` "gated_delta_net" (as
Megatron-Bridge configures it): ``linear_attention_freq`` says which layers are GDN, ``attention_output_gate`` puts a
sigmoid gate per query head into ``linear_qkv`` (``layout.fused.QKVG``; HF's ``q_proj`` holds [q_h; gate_h] per head),
``layernorm_zero_centered_gamma``, ``qk_layernorm``, ``rotary_percent``. A GDN layer's ``in_proj`` is
[q | k | v | z | beta | alpha] (``layout.fused.GDNInProj``): Qwen3-Next stores it as ``in_proj_qkvz`` and
``in_proj_ba``, interleaved per key head; Qwen3.5 as ``in_proj_qkv`` (q, k, v whole), ``in_proj_z``, ``in_proj_b``,
``in_proj_a``. Each section splits over TP on its own (``layout.rules.GDN_RULES``). The gated output norm is plain
x * w in HF and zero-centred in megatron-core: stored values differ by 1 (a shifted piece, ``Family.shifts``), exact
both ways for weights in [0.5, 2^8) in bf16 (2^24 in fp32), as Megatron-Bridge computes it.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..config import ModelConfig, linear_attention_freq
from ..errors import ConvertError
from .base import (
    ATTENTION_NAMES,
    DENSE_MLP,
    MLP_NORM,
    Imported,
    Name,
    expert_names,
    get,
    hybrid_problems,
    in_layer,
    layer_prefix,
    require_int,
)
from .gpt_oss import FULL
from .llama import gqa_import, gqa_to_hf
from .moe import SHARED_NAMES, MoE

LINEAR = "linear_attention"
GDN_COMMON: tuple[Name, ...] = (
    ("input_layernorm.weight", "input_layernorm.weight", None),
    ("linear_attn.conv1d.weight", "self_attention.conv1d.weight", None),
    ("linear_attn.A_log", "self_attention.A_log", None),
    ("linear_attn.dt_bias", "self_attention.dt_bias", None),
    ("linear_attn.norm.weight", "self_attention.out_norm.weight", None),
    ("linear_attn.out_proj.weight", "self_attention.out_proj.weight", None),
)
IN_PROJ = "self_attention.in_proj.weight"
GDN_FUSED: tuple[Name, ...] = (("linear_attn.in_proj_qkvz.weight", IN_PROJ, "gdn_qkvz"),
                               ("linear_attn.in_proj_ba.weight", IN_PROJ, "gdn_ba"))
GDN_FLAT: tuple[Name, ...] = (("linear_attn.in_proj_qkv.weight", IN_PROJ, "gdn_qkv"),
                              ("linear_attn.in_proj_z.weight", IN_PROJ, "gdn_z"),
                              ("linear_attn.in_proj_b.weight", IN_PROJ, "gdn_b"),
                              ("linear_attn.in_proj_a.weight", IN_PROJ, "gdn_a"))
# the gated attention: q_proj holds each head's query and output gate
GATED_ATTENTION: tuple[Name, ...] = tuple(
    (hf, lg, "q_gate" if hf == "self_attn.q_proj.weight" else part) for hf, lg, part in ATTENTION_NAMES
    if ".bias" not in hf)
PARTIAL_ROTARY_DEFAULT = 0.25  # Qwen3NextConfig's and Qwen3_5TextConfig's default
GDN_SIZES = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
             "linear_conv_kernel_dim")


def linear_pattern(hf: dict[str, Any], layers: int) -> tuple[int, ...]:
    """1 per Gated DeltaNet layer, from ``layer_types`` (or the older ``full_attention_interval``: every N-th layer
    is full attention); refused in one line when a type is neither."""
    types = hf.get("layer_types")
    if types is None:
        n = require_int(hf, "full_attention_interval", default=4)
        types = [FULL if (i + 1) % n == 0 else LINEAR for i in range(layers)]
    if len(types) != layers or set(types) - {LINEAR, FULL}:
        raise ConvertError(f"layer_types {types} are not one of {LINEAR!r} / {FULL!r} per layer ({layers} layers)",
                           "convert a config whose layer_types list linear_attention or full_attention per layer")
    return tuple(int(t == LINEAR) for t in types)


def rotary_share(hf: dict[str, Any]) -> float:
    """The rotated share of each head as transformers reads it (``rope_parameters`` first, then the top level)."""
    params = hf.get("rope_parameters") or {}
    value = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    return PARTIAL_ROTARY_DEFAULT if value is None else float(value)


@dataclass(frozen=True, kw_only=True)
class GatedDeltaNet(MoE):
    """One of the Gated DeltaNet families; ``fused_in_proj``: Qwen3-Next's in_proj_qkvz / in_proj_ba (else Qwen3.5's
    four flat projections); ``experts``: MoE layers with a gated shared expert (else dense)."""

    fused_in_proj: bool = False
    experts: bool = True
    # config.json states norm_topk_prob / decoder_sparse_step / mlp_only_layers (Qwen3-Next); Qwen3.5-MoE's router
    # always renormalises its top-k and every layer is MoE
    router_keys: bool = True
    qk_norm: bool = True
    shared_expert: bool = True
    scope: ClassVar[str] = "no supported Hugging Face family (Qwen3NextForCausalLM, Qwen3_5ForCausalLM and " \
                           "Qwen3_5MoeForCausalLM included)"
    shifts: ClassVar[dict[str, float]] = {"linear_attn.norm.weight": 1.0}  # HF's w = megatron-core's w + 1
    # the releases' multi-token-prediction layer (transformers ignores it too)
    unconverted: ClassVar[dict[str, str]] = {"mtp.": "the multi-token-prediction layer, not converted yet"}

    def from_hf(self, hf: dict[str, Any], vocab_divisible_by: int | None) -> Imported:
        layers = require_int(hf, "num_hidden_layers")
        if hf.get("attention_bias"):
            raise ConvertError("attention_bias=true: megatron-core's gated attention here has no q/k/v biases",
                               "convert a config with attention_bias false (as the releases have)")
        params = hf.get("rope_parameters") or {}
        if params.get("rope_type", "default") != "default":
            raise ConvertError(f"RoPE type {params['rope_type']!r}: megatron-core's gated attention here rotates "
                               "with plain RoPE", "convert a config whose rope_parameters.rope_type is default")
        notes: list[str] = []
        if params.get("mrope_section"):
            notes.append("Qwen3.5's interleaved multimodal RoPE equals plain RoPE for text-only positions; the "
                         "converted model is the text model")
        model: dict[str, Any] = {}
        args: dict[str, Any] = {}
        if self.experts:
            fixed = {} if self.router_keys else {"norm_topk_prob": True, "decoder_sparse_step": 1,
                                                 "mlp_only_layers": []}
            model, args = self._moe_from_hf({**hf, **fixed}, layers, notes)
        pattern = linear_pattern(hf, layers)
        gdn = {k: require_int(hf, k) for k in GDN_SIZES}
        model.update(linear_attention_pattern=pattern, attention_output_gate=True, zero_centered_gamma=True, **gdn)
        sized = {**hf, "intermediate_size": hf.get("intermediate_size") or require_int(hf, "moe_intermediate_size")}
        _, cfg, ns, more = gqa_import(sized, vocab_divisible_by, qkv_bias=False, qk_norm=True, sliding_default=False,
                                      model=model, args=args)
        for key, value in dict(experimental_attention_variant="gated_delta_net", attention_output_gate=True,
                               layernorm_zero_centered_gamma=True, apply_layernorm_1p=True,
                               rotary_percent=rotary_share(hf), **gdn).items():
            setattr(ns, key, value)
        ns.linear_attention_freq = linear_attention_freq(pattern)
        return Imported(cfg=cfg, args=ns, notes=more + notes)

    def to_hf(self, cfg: ModelConfig, args: argparse.Namespace, base: dict[str, Any] | None,
              dtype: torch.dtype) -> dict[str, Any]:
        hf, same = gqa_to_hf(self, cfg, args, base, dtype)
        if self.experts:
            moe = self._moe_to_hf(cfg, args, hf if same else {})
            if not self.router_keys:
                for key in ("norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"):
                    moe.pop(key)
            hf.update(moe)
            if same and "intermediate_size" not in (base or {}):  # Qwen3.5-MoE states only the experts' size
                hf.pop("intermediate_size", None)
        assert cfg.linear_attention_pattern is not None
        hf.update({k: getattr(cfg, k) for k in GDN_SIZES})
        kept = same and "layer_types" not in hf and linear_pattern(hf, cfg.num_layers) == cfg.linear_attention_pattern
        if not kept:  # else the source's full_attention_interval says it
            hf["layer_types"] = [LINEAR if g else FULL for g in cfg.linear_attention_pattern]
        if not same:
            share = float(get(vars(args), "rotary_percent", PARTIAL_ROTARY_DEFAULT))
            hf.pop("rope_theta", None)
            hf.update(partial_rotary_factor=share, hidden_act="silu", attention_bias=False,
                      rope_parameters={"rope_type": "default", "rope_theta": float(get(vars(args), "rotary_base",
                                                                                        10000000.0)),
                                       "partial_rotary_factor": share})
        return hf

    def affinity(self, cfg: ModelConfig) -> int:
        if cfg.linear_attention_pattern is None:
            return 0
        return 10 if bool(cfg.num_experts) == self.experts and (self.fused_in_proj or not self.experts) else 9

    def why_not(self, cfg: ModelConfig, args: argparse.Namespace) -> str | None:
        problems = hybrid_problems(cfg, gdn=True)
        if cfg.family != "gpt" or cfg.mla or cfg.mtp_num_layers or cfg.post_norms or cfg.softmax_type != "vanilla":
            problems.append("an architecture other than Qwen3-Next's (encoder-decoder, MLA, MTP layers, sandwich "
                            "norms or attention sinks)")
        if not (cfg.swiglu and cfg.activation == "silu") or cfg.normalization != "RMSNorm" \
                or not cfg.zero_centered_gamma or not cfg.qk_layernorm:
            problems.append("an MLP or norms other than Qwen3-Next's (SwiGLU, zero-centred RMSNorm, q/k norms)")
        if cfg.add_bias_linear or cfg.add_qkv_bias or cfg.position_embedding_type != "rope":
            problems.append("linear biases or position embeddings other than RoPE")
        if problems:
            return ", ".join(problems)
        if bool(cfg.num_experts) != self.experts:
            return "Mixture-of-Experts layers" if cfg.num_experts else "no Mixture-of-Experts layers"
        if self.experts and not self.router_keys and (cfg.moe_layer_pattern is not None
                                                      or getattr(args, "moe_router_pre_softmax", False)):
            return "dense layers between MoE layers or a router that does not renormalise its top-k (Qwen3.5-MoE " \
                   "has neither)"
        return self.moe_problem(cfg) if self.experts else None

    def layer_names(self, cfg: ModelConfig, stack: str, layer: int) -> list[Name]:
        gdn = stack == "decoder" and cfg.linear_attention_pattern is not None and cfg.linear_attention_pattern[layer]
        names: list[Name] = list(GDN_COMMON + (GDN_FUSED if self.fused_in_proj else GDN_FLAT)) if gdn else \
            list(GATED_ATTENTION)
        names += MLP_NORM
        if cfg.layer_is_moe(stack, layer):
            names += [("mlp.gate.weight", "mlp.router.weight", None)]
            names += expert_names("mlp", cfg.num_experts) + list(SHARED_NAMES)
        else:
            names += DENSE_MLP
        return in_layer(names, layer_prefix(stack, layer))


FAMILIES = (
    GatedDeltaNet(architecture="Qwen3NextForCausalLM", model_type="qwen3_next", fused_in_proj=True),
    GatedDeltaNet(architecture="Qwen3_5ForCausalLM", model_type="qwen3_5_text", experts=False),
    GatedDeltaNet(architecture="Qwen3_5MoeForCausalLM", model_type="qwen3_5_moe_text", router_keys=False),
)
