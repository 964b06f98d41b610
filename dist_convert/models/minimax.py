"""MiniMax-M2 (``MiniMaxM2ForCausalLM``; M2.1, M2.5 and M2.7 share it): GQA attention whose queries and keys are
RMS-normalised over all heads at once (``Attention.qk_norm_full``), partial RoPE, and every layer Mixture of Experts
under Mixtral's on-disk names (``block_sparse_moe.experts.{e}.w1 / w3 / w2``) with DeepSeek-V3's router without
groups: sigmoid scores, a correction bias for the choice (``e_score_correction_bias``), the top-k renormalised.

The Megatron side is Megatron-Bridge 0.6.2's MiniMax-M2 model: GPTModel with ``minimax_m2_layer_spec`` (its
full-width q/k norm modules, split over TP with the heads and all-reducing their sum of squares), expert bias, sigmoid
routing. config.json states the rotated share twice: transformers reads ``partial_rotary_factor`` (in
``rope_parameters``; absent: 1), Megatron-Bridge ``rotary_dim / head_dim``: a config where the two disagree is
refused, and an export writes both.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..config import ModelConfig
from ..errors import ConvertError
from .base import Allowed, Imported, in_layer, layer_prefix
from .moe import MoE
from .rows import Plain, Row

BIAS = Plain(hf="block_sparse_moe.e_score_correction_bias", logical="mlp.router.expert_bias")


@dataclass(frozen=True, kw_only=True)
class MiniMaxM2(MoE):
    def from_hf(self, hf: dict[str, Any], vocab_divisible_by: int | None) -> Imported:
        if hf.get("scoring_func", "sigmoid") != "sigmoid":
            raise ConvertError(f"scoring_func={hf['scoring_func']!r}: {self.architecture} routes by sigmoid scores "
                               "(transformers' MiniMaxM2 ignores the key)",
                               "convert a config with scoring_func sigmoid")
        imported = super().from_hf(hf, vocab_divisible_by)
        cfg = imported.cfg
        moe = cfg.moe
        assert moe is not None
        if moe.topk < 2:
            raise ConvertError(f"num_experts_per_tok={moe.topk}: {self.architecture} renormalises its top-k sigmoid "
                               "scores, megatron-core only when top-k > 1", "convert a config routing to 2 or more "
                                                                            "experts per token")
        rotary_dim = hf.get("rotary_dim")
        if rotary_dim is not None and int(rotary_dim) != round(cfg.position.percent * cfg.kv_channels):
            raise ConvertError(f"rotary_dim={rotary_dim} (Megatron-Bridge's rotated share: {rotary_dim} of "
                               f"head_dim {cfg.kv_channels}) contradicts partial_rotary_factor "
                               f"{cfg.position.percent} (transformers')", "convert a config whose rotary_dim is "
                                                                          "partial_rotary_factor x head_dim")
        moe = replace(moe, score_function="sigmoid", expert_bias=True, pre_softmax=False)
        return Imported(cfg=cfg.replace(moe=moe, attention__qk_norm_split=True), notes=imported.notes)

    @property
    def hf_keys(self) -> frozenset[str]:
        return super().hf_keys | {"rope.partial_rotary_factor", "scoring_func", "use_qk_norm"}

    def to_hf(self, cfg: ModelConfig, base: dict[str, Any] | None, dtype: torch.dtype) -> dict[str, Any]:
        hf = super().to_hf(cfg, base, dtype)
        hf["rotary_dim"] = round(cfg.position.percent * cfg.kv_channels)  # Megatron-Bridge's reading of the share
        if "scoring_func" in hf:
            hf["scoring_func"] = "sigmoid"
        return hf

    def expresses(self) -> Mapping[str, Allowed]:
        """Full-width q/k norms, partial plain RoPE, every layer MoE routed by sigmoid scores with a correction bias
        to 2 or more renormalised experts."""
        out = dict(super().expresses())
        out.update({"position.percent": lambda v, cfg: 0.0 < v <= 1.0, "moe.score_function": {"sigmoid"},
                    "moe.expert_bias": lambda v, cfg: v and cfg.moe.topk > 1, "moe.pre_softmax": {False}})
        return out

    def layer_names(self, cfg: ModelConfig, stack: str, layer: int) -> list[Row]:
        return super().layer_names(cfg, stack, layer) + in_layer((BIAS,), layer_prefix(stack, layer))


FAMILIES = (
    MiniMaxM2(architecture="MiniMaxM2ForCausalLM", model_type="minimax_m2", qk_norm=True, qk_norm_full=True,
              block="block_sparse_moe", expert_proj=("w1", "w3", "w2"), dense_layers=False, norm_topk_key=False,
              experts_key="num_local_experts"),
)
