"""Attention (q/k norms per head or over all heads, softmax scale and type, sliding windows and their per-layer
pattern, output gates), the norms (kind, epsilon, zero-centred gamma, sandwich norms, where the residual is taken) and
the embedding's scaling."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from ..errors import ConvertError
from .base import DERIVED, LAYOUT, MODEL, Feature, MegatronArg, setting

if TYPE_CHECKING:  # a record reads the model's and the layout's attributes; it imports neither module
    from ..config import ModelConfig
    from ..layout.topology import Layout


@dataclass(frozen=True, kw_only=True)
class Attention(Feature):
    attr: ClassVar[str] = "attention"
    essential: ClassVar[tuple[str, ...] | None] = ("qk_norm",)

    qk_norm: bool = setting(False, arg="qk_layernorm", what="q/k layernorms (MLA: the q/kv down-projection norms)",
                            mlm=MegatronArg("B", MODEL))
    qk_norm_full: bool = setting(False, arg="qk_norm_full_width",
                                 what="q/k norms over all heads at once (OLMoE, MiniMax-M2), not per head")
    # which Megatron-Bridge spec builds the full-width norms: Transformer Engine norms over the whole width (its OLMoE
    # spec; each TP rank normalises its own heads, so it computes the model at TP 1 only) or its MiniMax-M2 modules
    # (split over TP with the heads, the sum of squares all-reduced; no _extra_state)
    qk_norm_split: bool = setting(False, kind=LAYOUT, arg="qk_norm_full_width_split",
                                  what="full-width q/k norms split over TP (Megatron-Bridge's MiniMax-M2 modules)")
    qk_l2_norm: bool = setting(False, arg="qk_l2_norm", what="L2-normalised queries and keys", mlm=MegatronArg("B"))
    softmax_scale: float | None = setting(None, arg="softmax_scale",
                                          what="the attention softmax scale (None: 1/sqrt(head dim))")
    softmax_type: str = setting("vanilla", arg="softmax_type",
                                what="the attention softmax: vanilla, off-by-one or learnable (sinks)")
    window: tuple[int, int] | None = setting(None, arg="window_size",
                                             what="the sliding attention window (left, right)")
    window_skip_freq: Any = setting(None, arg="window_attn_skip_freq",
                                    what="which layers slide (megatron-core's window_attn_skip_freq)")
    window_pattern: tuple[int, int] | None = setting(None, arg="interleaved_attn_pattern",
                                                     what="(sliding, global) layers repeated (Megatron-Bridge's "
                                                          "Gemma 3 interleaved_attn_pattern)")
    output_gate: bool = setting(False, arg="attention_output_gate", what="sigmoid output gates per query head")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.qk_norm_split and not self.qk_norm_full:
            raise ConvertError("qk_norm_full_width_split=True without qk_norm_full_width: only full-width q/k norms "
                               "split over TP", "correct the source's config (its args)")
        if self.qk_norm_full and not self.qk_norm:
            raise ConvertError("qk_norm_full_width=True without qk_layernorm: a full-width q/k norm is a q/k norm",
                               "correct the source's config (its args or config.json)")

    def check_layout(self, cfg: ModelConfig, layout: Layout, what: str) -> None:
        if self.qk_norm_full and cfg.mla is not None:
            raise ConvertError("qk_norm_full_width=True on multi-latent attention, whose q/kv norms are its latents'",
                               "correct the source's config (its args or config.json)")

    @property
    def uses_te2_spec(self) -> bool:
        return self.qk_norm_full  # Megatron-Bridge's OLMoE / MiniMax-M2 specs: Transformer Engine 2's modules

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Attention:
        values = cls.args_values(args)
        window = values["window"]
        if isinstance(window, int):  # Megatron-Bridge's Gemma 3 provider: the HF window W, (W - 1, 0) on local layers
            window = (window - 1, 0)
        return cls(**{**values, "window": window, "window_skip_freq": values["window_skip_freq"] if window else None,
                      "window_pattern": values["window_pattern"] if window else None})

    def to_args(self) -> dict[str, Any]:  # the window and its pattern as megatron-core's config types them (tuples)
        return {**super().to_args(), "window_size": self.window, "interleaved_attn_pattern": self.window_pattern}


@dataclass(frozen=True, kw_only=True)
class Norms(Feature):
    attr: ClassVar[str] = "norm"
    essential: ClassVar[tuple[str, ...] | None] = ("kind",)

    kind: str = setting("RMSNorm", arg="normalization", what="the norm: RMSNorm or LayerNorm",
                        mlm=MegatronArg("LB", MODEL, "LayerNorm"))
    eps: float = setting(1e-5, arg=("layernorm_epsilon", "norm_epsilon"), what="the norm epsilon",
                         mlm=(MegatronArg("B", DERIVED), MegatronArg("B", DERIVED)))
    zero_centered_gamma: bool = setting(False, arg=("layernorm_zero_centered_gamma", "apply_layernorm_1p"),
                                        what="norms computing x * (1 + w) (zero-centred gamma)",
                                        mlm=(MegatronArg("B", DERIVED), MegatronArg("LB", DERIVED)))
    post_norms: bool = setting(False, arg="post_norms",
                               what="sandwich norms on the attention and MLP outputs (Gemma 2/3)")
    residual_post_norm: bool = setting(False, arg="apply_residual_connection_post_layernorm",
                                       what="residuals taken after the pre-norm")

    @property
    def bias(self) -> bool:
        """LayerNorm has a bias, RMSNorm none."""
        return self.kind == "LayerNorm"

    @property
    def uses_te2_spec(self) -> bool:
        return self.post_norms  # Megatron-Bridge's Gemma 2/3 spec


@dataclass(frozen=True, kw_only=True)
class Embedding(Feature):
    attr: ClassVar[str] = "embedding"
    essential: ClassVar[tuple[str, ...] | None] = ()

    multiplier: float = setting(1.0, arg="embedding_multiplier",
                                what="the embedding output scale (Megatron-Bridge's Gemma 3: sqrt(hidden))")
    mup: bool = setting(False, arg="use_mup", what="muP scaling of embeddings, attention and logits")
