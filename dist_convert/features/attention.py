"""Attention (q/k norms, softmax scale and type, sliding windows and their per-layer pattern, output gates), the
norms (kind, epsilon, zero-centred gamma, sandwich norms, where the residual is taken) and the embedding's scaling."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, ClassVar

from .base import DERIVED, MODEL, Feature, MegatronArg, as_tuple, get, setting


@dataclass(frozen=True, kw_only=True)
class Attention(Feature):
    attr: ClassVar[str] = "attention"
    essential: ClassVar[tuple[str, ...] | None] = ("qk_norm",)

    qk_norm: bool = setting(False, arg="qk_layernorm", what="q/k layernorms (MLA: the q/kv down-projection norms)",
                            mlm=MegatronArg("B", MODEL))
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

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Attention:
        a = vars(args)
        window = as_tuple(get(a, "window_size"))
        if isinstance(window, int):  # Megatron-Bridge's Gemma 3 provider: the HF window W, (W - 1, 0) on local layers
            window = (window - 1, 0)
        scale = get(a, "softmax_scale")
        return cls(qk_norm=bool(get(a, "qk_layernorm", default=False)),
                   qk_l2_norm=bool(get(a, "qk_l2_norm", default=False)),
                   softmax_scale=None if scale is None else float(scale),
                   softmax_type=str(get(a, "softmax_type", default="vanilla")),
                   window=window,
                   window_skip_freq=as_tuple(get(a, "window_attn_skip_freq")) if window else None,
                   window_pattern=as_tuple(get(a, "interleaved_attn_pattern")) if window else None,
                   output_gate=bool(get(a, "attention_output_gate", default=False)))

    def to_args(self) -> dict[str, Any]:
        out: dict[str, Any] = {"qk_layernorm": self.qk_norm}
        for name, value in (("qk_l2_norm", self.qk_l2_norm), ("softmax_scale", self.softmax_scale),
                            ("softmax_type", self.softmax_type), ("window_size", self.window),
                            ("window_attn_skip_freq", self.window_skip_freq),
                            ("interleaved_attn_pattern", self.window_pattern),
                            ("attention_output_gate", self.output_gate)):
            out[name] = list(value) if isinstance(value, tuple) and name == "window_attn_skip_freq" else value
        return out


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

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Norms:
        a = vars(args)
        return cls(kind=str(get(a, "normalization", default="LayerNorm")),
                   eps=float(get(a, "layernorm_epsilon", "norm_epsilon", default=1e-5)),
                   zero_centered_gamma=bool(get(a, "layernorm_zero_centered_gamma", "apply_layernorm_1p",
                                                default=False)),
                   post_norms=bool(get(a, "post_norms", default=False)),
                   residual_post_norm=bool(get(a, "apply_residual_connection_post_layernorm", default=False)))

    def to_args(self) -> dict[str, Any]:
        out: dict[str, Any] = {"normalization": self.kind, "layernorm_epsilon": self.eps, "norm_epsilon": self.eps,
                               "layernorm_zero_centered_gamma": self.zero_centered_gamma,
                               "apply_layernorm_1p": self.zero_centered_gamma,
                               "apply_residual_connection_post_layernorm": self.residual_post_norm,
                               "post_norms": self.post_norms}
        return out


@dataclass(frozen=True, kw_only=True)
class Embedding(Feature):
    attr: ClassVar[str] = "embedding"
    essential: ClassVar[tuple[str, ...] | None] = ()

    multiplier: float = setting(1.0, arg="embedding_multiplier",
                                what="the embedding output scale (Megatron-Bridge's Gemma 3: sqrt(hidden))")
    mup: bool = setting(False, arg="use_mup", what="muP scaling of embeddings, attention and logits")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Embedding:
        a = vars(args)
        return cls(multiplier=float(get(a, "embedding_multiplier", default=1.0)),
                   mup=bool(get(a, "use_mup", default=False)))

    def to_args(self) -> dict[str, Any]:
        return {"embedding_multiplier": self.multiplier, "use_mup": self.mup}
