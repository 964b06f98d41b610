"""Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE (``*ForCausalLM``): Llama-shaped attention with Mixture-of-Experts MLPs
(a softmax router; Qwen2-MoE adds a sigmoid-gated shared expert; the Qwen families may keep dense layers between MoE
layers; OLMoE normalises queries and keys over all heads at once, ``Attention.qk_norm_full``: Megatron-Bridge's OLMoE /
MiniMax-M2 norm modules, not megatron-core's per-head ``qk_layernorm``). transformers >= 5 may store all experts of a
layer in one tensor (``save_original_format=False``): read as an alternative layout (``alternatives``)."""
from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..config import ModelConfig
from ..errors import ConvertError
from ..features import MoE as MoERecord
from ..layout.boxes import Box, Piece
from ..layout.rules import LAYER_PREFIX, logical_tensors
from .base import (
    ANY,
    ATTENTION,
    EXPERT_FC1,
    EXPERT_FC2,
    GATED_MLP,
    PRE_MLP_NORM,
    Allowed,
    Family,
    HFTensors,
    Imported,
    expert_names,
    in_layer,
    layer_prefix,
    require_int,
)
from .llama import GQA_HF_KEYS, gqa_expresses, gqa_import, gqa_to_hf
from .rows import GLU, Plain, Row

SHARED_NAMES: tuple[Row, ...] = (
    GLU(logical="mlp.shared_experts.linear_fc1.weight", gate="mlp.shared_expert.gate_proj.weight",
        up="mlp.shared_expert.up_proj.weight"),
    Plain(hf="mlp.shared_expert.down_proj.weight", logical="mlp.shared_experts.linear_fc2.weight"),
    Plain(hf="mlp.shared_expert_gate.weight", logical="mlp.shared_experts.gate_weight"),
)
# transformers >= 5 with save_original_format=False: all experts of a layer in one tensor, leading axis = expert
FUSED_FC1, FUSED_FC2, FUSED_ROUTER = "mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"
MOE_HF_KEYS = frozenset({"norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "shared_expert_intermediate_size",
                         "qkv_bias"})


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
    qk_norm_full: bool = False  # the q/k norms span all heads at once (OLMoE)
    no_head_dim: bool = False  # the config class has no head size: heads of hidden / heads (OLMoE)
    block: str = "mlp"  # module of an MoE layer on disk (Mixtral: block_sparse_moe)
    expert_proj: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # per expert: gate, up, down
    shared_expert: bool = False  # every MoE layer has a sigmoid-gated shared expert (Qwen2-MoE)
    dense_layers: bool = True  # dense MLP layers may sit between MoE layers (Qwen); Mixtral, OLMoE: every layer MoE
    window: bool = False  # config.json's sliding_window slides every layer (Mixtral)
    norm_topk_key: bool = True  # config.json's norm_topk_prob says whether the top-k renormalise (Mixtral: always)
    experts_key: str = "num_experts"  # config.json's expert count of a family without dense layers
    qkv_bias_flag: bool = False  # config.json's "qkv_bias" switches the q/k/v biases (Qwen2-MoE)

    # -- config.json <-> model ---------------------------------------------------------------------------
    def from_hf(self, hf: dict[str, Any], vocab_divisible_by: int | None) -> Imported:
        layers = require_int(hf, "num_hidden_layers")
        notes: list[str] = []
        moe = self.moe_from_hf(hf, layers, notes)
        qkv_bias = bool(hf.get("qkv_bias", self.qkv_bias)) if self.qkv_bias_flag else self.qkv_bias
        cfg = gqa_import(hf, vocab_divisible_by, self.architecture, qkv_bias=qkv_bias, qk_norm=self.qk_norm,
                         window=self.window, moe=moe)
        return Imported(cfg=cfg.replace(attention__qk_norm_full=self.qk_norm_full), notes=notes)

    @property
    def hf_keys(self) -> frozenset[str]:
        return GQA_HF_KEYS | MOE_HF_KEYS | {"sliding_window", "use_sliding_window", "layer_types"}

    def moe_from_hf(self, hf: dict[str, Any], layers: int, notes: list[str]) -> MoERecord:
        experts = require_int(hf, "num_local_experts", "num_experts")
        topk = require_int(hf, "num_experts_per_tok", default=2)
        pre_softmax = not bool(hf.get("norm_topk_prob", False)) if self.norm_topk_key else False
        if self.dense_layers:  # Qwen-MoE: experts of moe_intermediate_size, dense layers of intermediate_size
            expert_ffn = require_int(hf, "moe_intermediate_size")
            pattern: tuple[int, ...] | None = hf_moe_pattern(
                layers, require_int(hf, "decoder_sparse_step", default=1), list(hf.get("mlp_only_layers") or []))
            if all(pattern):
                pattern = None
        else:  # Mixtral, OLMoE: every layer MoE, experts of intermediate_size
            expert_ffn, pattern = require_int(hf, "intermediate_size"), None
            if float(hf.get("router_jitter_noise") or 0.0):
                notes.append(f"router_jitter_noise={hf['router_jitter_noise']} (training-time noise) has no "
                             "Megatron-LM argument; it is kept only in the origin's config.json")
        shared = require_int(hf, "shared_expert_intermediate_size", default=0) if self.shared_expert else 0
        return MoERecord(num_experts=experts, ffn=expert_ffn, layer_pattern=pattern, shared_size=shared or None,
                         shared_gate=bool(shared), topk=topk, score_function="softmax", pre_softmax=pre_softmax)

    def to_hf(self, cfg: ModelConfig, base: dict[str, Any] | None, dtype: torch.dtype) -> dict[str, Any]:
        hf, same = gqa_to_hf(self, cfg, base, dtype)
        hf.update(self.moe_to_hf(cfg, hf if same else {}))
        if self.no_head_dim:
            hf.pop("head_dim")
        if self.window:
            hf["sliding_window"] = cfg.attention.window[0] + 1 if cfg.attention.window else None
        return hf

    def moe_to_hf(self, cfg: ModelConfig, base: dict[str, Any]) -> dict[str, Any]:
        """The MoE keys of ``config.json`` (``base``: the same family's original config, or empty)."""
        moe = cfg.moe
        assert moe is not None
        if not self.dense_layers:  # Mixtral, OLMoE: experts of intermediate_size
            return {self.experts_key: cfg.num_experts,
                    "num_experts_per_tok": moe.topk, "intermediate_size": cfg.expert_ffn,
                    **({"norm_topk_prob": not moe.pre_softmax} if self.norm_topk_key else {})}
        pattern = moe.layer_pattern or (1,) * cfg.num_layers
        step, only = base.get("decoder_sparse_step", 1), base.get("mlp_only_layers") or []
        if not (isinstance(step, int) and step >= 1 and hf_moe_pattern(cfg.num_layers, step, list(only)) == pattern):
            step, only = 1, [layer for layer, is_moe in enumerate(pattern) if not is_moe]
        out: dict[str, Any] = {
            "num_local_experts" if "num_local_experts" in base else "num_experts": cfg.num_experts,
            "num_experts_per_tok": moe.topk, "moe_intermediate_size": cfg.expert_ffn, "decoder_sparse_step": step,
            "mlp_only_layers": list(only), "norm_topk_prob": not moe.pre_softmax}
        if self.shared_expert:
            out["shared_expert_intermediate_size"] = moe.shared_size
        if self.qkv_bias_flag:
            out["qkv_bias"] = cfg.add_qkv_bias
        return out

    def expresses(self) -> Mapping[str, Allowed]:
        out = {**gqa_expresses(qkv_bias=None if self.qkv_bias_flag else self.qkv_bias, qk_norm=self.qk_norm),
               "attention.qk_norm_full": {self.qk_norm_full}, **self.moe_expresses()}
        if self.no_head_dim:  # OLMoE sizes its full-width q norm by hidden_size: heads of hidden / heads each
            out["attention.qk_norm_full"] = lambda v, cfg: v == self.qk_norm_full and \
                cfg.kv_channels * cfg.num_attention_heads == cfg.hidden_size
        if self.window:  # Mixtral: a window on every layer
            out["attention.window"] = lambda w, cfg: w is None or (w[1] == 0 and w[0] >= 0)
        return out

    def moe_expresses(self) -> dict[str, Allowed]:
        """What the family writes of its Mixture of Experts: softmax routing (renormalised or not where
        norm_topk_prob says so), dense layers between MoE layers (Qwen), gated shared experts (Qwen2-MoE)."""
        return {"moe": {True}, "moe.score_function": {"softmax"},
                "moe.pre_softmax": ANY if self.norm_topk_key else {False},
                "moe.layer_pattern": ANY if self.dense_layers else {None},
                "moe.shared_size": (lambda v, cfg: v is not None) if self.shared_expert else {None},
                "moe.shared_gate": {self.shared_expert}}

    # -- names --------------------------------------------------------------------------------------------
    def layer_names(self, cfg: ModelConfig, stack: str, layer: int) -> list[Row]:
        rows: list[Row] = list(ATTENTION + PRE_MLP_NORM)
        if cfg.is_moe_layer(layer):
            rows.append(Plain(hf=f"{self.block}.gate.weight", logical="mlp.router.weight"))
            rows += expert_names(self.block, cfg.num_experts, self.expert_proj)
            rows += SHARED_NAMES if self.shared_expert else ()
        else:
            rows += GATED_MLP
        return in_layer(rows, layer_prefix(stack, layer))

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


FAMILIES = (  # in the order of preference (models/__init__.py)
    MoE(architecture="MixtralForCausalLM", model_type="mixtral", block="block_sparse_moe",
        expert_proj=("w1", "w3", "w2"), dense_layers=False, window=True, norm_topk_key=False,
        experts_key="num_local_experts"),
    MoE(architecture="Qwen2MoeForCausalLM", model_type="qwen2_moe", qkv_bias=True, shared_expert=True,
        qkv_bias_flag=True),
    MoE(architecture="Qwen3MoeForCausalLM", model_type="qwen3_moe", qk_norm=True),
    MoE(architecture="OlmoeForCausalLM", model_type="olmoe", qk_norm=True, qk_norm_full=True, dense_layers=False,
        no_head_dim=True),
)
