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
``in_proj_a``. Each section splits over TP on its own (``layout.hybrid.GDN_RULES``). The gated output norm is plain
x * w in HF and zero-centred in megatron-core: stored values differ by 1 (a shifted piece, ``Family.shifts``), exact
both ways for weights in [0.5, 2^8) in bf16 (2^24 in fp32), as Megatron-Bridge computes it.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..config import ModelConfig
from ..errors import ConvertError
from ..features import GDN
from .base import (
    GATED_MLP,
    INPUT_NORM,
    O_PROJ,
    PRE_MLP_NORM,
    QK_NORMS,
    Allowed,
    Imported,
    expert_names,
    in_layer,
    layer_prefix,
    require_int,
)
from .gpt_oss import FULL
from .llama import gqa_expresses, gqa_import, gqa_to_hf
from .moe import SHARED_NAMES, MoE
from .rows import GatedQKV, GDNFused, GDNSplit, Plain, Row

LINEAR = "linear_attention"
GDN_COMMON: tuple[Row, ...] = (INPUT_NORM, *(Plain(hf=hf, logical=lg) for hf, lg in (
    ("linear_attn.conv1d.weight", "self_attention.conv1d.weight"),
    ("linear_attn.A_log", "self_attention.A_log"),
    ("linear_attn.dt_bias", "self_attention.dt_bias"),
    ("linear_attn.norm.weight", "self_attention.out_norm.weight"),
    ("linear_attn.out_proj.weight", "self_attention.out_proj.weight"),
)))
IN_PROJ = "self_attention.in_proj.weight"
GDN_FUSED = GDNFused(logical=IN_PROJ, qkvz="linear_attn.in_proj_qkvz.weight", ba="linear_attn.in_proj_ba.weight")
GDN_FLAT = GDNSplit(logical=IN_PROJ, qkv="linear_attn.in_proj_qkv.weight", z="linear_attn.in_proj_z.weight",
                    b="linear_attn.in_proj_b.weight", a="linear_attn.in_proj_a.weight")
# the gated attention: q_proj holds each head's query and output gate; no q/k/v biases
GATED_ATTENTION: tuple[Row, ...] = (
    INPUT_NORM, GatedQKV(logical="self_attention.linear_qkv.weight", q="self_attn.q_proj.weight",
                         k="self_attn.k_proj.weight", v="self_attn.v_proj.weight"), *QK_NORMS, O_PROJ)
PARTIAL_ROTARY_DEFAULT = 0.25  # Qwen3NextConfig's and Qwen3_5TextConfig's default
# GDN record field -> config.json key
GDN_SIZES = {"num_key_heads": "linear_num_key_heads", "num_value_heads": "linear_num_value_heads",
             "key_head_dim": "linear_key_head_dim", "value_head_dim": "linear_value_head_dim",
             "conv_kernel_dim": "linear_conv_kernel_dim"}
MROPE_AS_ROPE = ("Qwen3.5's interleaved multimodal RoPE equals plain RoPE for text-only positions; the converted "
                 "model is the text model")
ANY_SHARE = lambda v, cfg: 0.0 < v <= 1.0  # noqa: E731  (any rotated share)


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
            notes.append(MROPE_AS_ROPE)
        moe = None
        if self.experts:
            fixed = {} if self.router_keys else {"norm_topk_prob": True, "decoder_sparse_step": 1,
                                                 "mlp_only_layers": []}
            moe = self.moe_from_hf({**hf, **fixed}, layers, notes)
        gdn = GDN(pattern=linear_pattern(hf, layers), **{f: require_int(hf, k) for f, k in GDN_SIZES.items()})
        sized = {**hf, "intermediate_size": hf.get("intermediate_size") or require_int(hf, "moe_intermediate_size")}
        cfg = gqa_import(sized, vocab_divisible_by, self.architecture, qkv_bias=False, qk_norm=True, moe=moe, gdn=gdn,
                         partial_default=PARTIAL_ROTARY_DEFAULT)
        cfg = cfg.replace(attention__output_gate=True, norm__zero_centered_gamma=True)
        return Imported(cfg=cfg, notes=notes)

    @property
    def hf_keys(self) -> frozenset[str]:
        return super().hf_keys | {"rope.partial_rotary_factor", "rope.mrope_section", "rope.mrope_interleaved"}

    def to_hf(self, cfg: ModelConfig, base: dict[str, Any] | None, dtype: torch.dtype) -> dict[str, Any]:
        hf, same = gqa_to_hf(self, cfg, base, dtype, partial_default=PARTIAL_ROTARY_DEFAULT)
        if self.experts:
            moe = self.moe_to_hf(cfg, hf if same else {})
            if not self.router_keys:
                for key in ("norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"):
                    moe.pop(key)
            hf.update(moe)
            if same and "intermediate_size" not in (base or {}):  # Qwen3.5-MoE states only the experts' size
                hf.pop("intermediate_size", None)
        gdn = cfg.gdn
        assert gdn is not None
        hf.update({k: getattr(gdn, f) for f, k in GDN_SIZES.items()})
        kept = same and "layer_types" not in hf and linear_pattern(hf, cfg.num_layers) == gdn.pattern
        if not kept:  # else the source's full_attention_interval says it
            hf["layer_types"] = [LINEAR if g else FULL for g in gdn.pattern]
        if not same:
            hf["attention_bias"] = False  # hidden_act: gqa_to_hf
        return hf

    def expresses(self) -> Mapping[str, Allowed]:
        """Gated DeltaNet layers beside gated full attention with q/k norms, zero-centred RMSNorms, partial plain
        RoPE, a SwiGLU MLP: dense (Qwen3.5) or MoE with a gated shared expert (Qwen3-Next, Qwen3.5-MoE; Qwen3.5-MoE
        every layer MoE and renormalising its top-k)."""
        out: dict[str, Allowed] = {**gqa_expresses(qkv_bias=False, qk_norm=True), "position.kind": {"rope"},
                                   "position.scaling": {None}, "position.percent": ANY_SHARE, "gdn": {True},
                                   "attention.output_gate": {True}, "norm.zero_centered_gamma": {True},
                                   "moe": {self.experts}}
        if self.experts:
            out.update(self.moe_expresses())
            if not self.router_keys:
                out.update({"moe.layer_pattern": {None}, "moe.pre_softmax": {False}})
        return out

    def layer_names(self, cfg: ModelConfig, stack: str, layer: int) -> list[Row]:
        gdn = stack == "decoder" and cfg.gdn is not None and cfg.gdn.pattern[layer]
        rows: list[Row] = [*GDN_COMMON, GDN_FUSED if self.fused_in_proj else GDN_FLAT] if gdn else \
            list(GATED_ATTENTION)
        rows += PRE_MLP_NORM
        if cfg.layer_is_moe(stack, layer):
            rows.append(Plain(hf="mlp.gate.weight", logical="mlp.router.weight"))
            rows += expert_names("mlp", cfg.num_experts) + list(SHARED_NAMES)
        else:
            rows += GATED_MLP
        return in_layer(rows, layer_prefix(stack, layer))


FAMILIES = (  # in the order of preference (models/__init__.py)
    GatedDeltaNet(architecture="Qwen3NextForCausalLM", model_type="qwen3_next", fused_in_proj=True),
    GatedDeltaNet(architecture="Qwen3_5ForCausalLM", model_type="qwen3_5_text", experts=False),
    GatedDeltaNet(architecture="Qwen3_5MoeForCausalLM", model_type="qwen3_5_moe_text", router_keys=False),
)
