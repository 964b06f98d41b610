"""Positional encoding: the kind (RoPE, YaRN, learned absolute, T5's relative buckets, none) and every RoPE
setting megatron-core applies (base, rotated share, interleaving, sequence-length interpolation, Gemma 3's local
base, layers without RoPE), with RoPE's frequency scaling as a record of its own kind (``Scaling``: Llama-3, linear,
YaRN, or what YaRN's parameters leave to multi-latent attention's softmax under plain RoPE)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, ClassVar

from ..errors import ConvertError
from .base import LAYOUT, MODEL, Feature, MegatronArg, as_tuple, get, setting

# the position embeddings megatron-core's models build (relative: T5's)
KINDS = ("rope", "yarn", "mrope", "learned_absolute", "relative", "none")
LLAMA3_DEFAULT_FACTOR = 8.0  # Megatron-LM's --rope-scaling-factor default


@dataclass(frozen=True, kw_only=True)
class Scaling(Feature):
    """How RoPE's frequencies are scaled: one record type per kind (``name``: the kind, as settings and refusals say
    it), each with its own fields and ``args`` names. Held by ``Position.scaling``."""

    attr: ClassVar[str] = "scaling"
    name: ClassVar[str] = ""

    @classmethod
    def variants(cls) -> tuple[type[Feature], ...]:
        return (Llama3, Linear, Yarn, MLASoftmax) if cls is Scaling else (cls,)


@dataclass(frozen=True, kw_only=True)
class Llama3(Scaling):
    """Llama-3's frequency scaling (megatron-core's ``rope_scaling``; its other parameters are fixed)."""

    name: ClassVar[str] = "llama3"
    factor: float = setting(LLAMA3_DEFAULT_FACTOR, arg="rope_scaling_factor", what="the Llama-3 RoPE scaling factor",
                            mlm=MegatronArg("B"))


@dataclass(frozen=True, kw_only=True)
class Linear(Scaling):
    """Linear scaling of the frequencies (Megatron-Bridge's Gemma 3: the global layers, beside a local base)."""

    name: ClassVar[str] = "linear"
    factor: float = setting(1.0, arg="rope_scaling_factor", what="the linear RoPE scaling factor")


@dataclass(frozen=True, kw_only=True)
class Yarn(Scaling):
    """YaRN (``position_embedding_type`` / multi-latent attention's ``rope_type`` yarn). The defaults are Megatron-LM's
    for GPT attention (``_apply_yarn_config_from_args``); multi-latent attention's are ``MLA_YARN``."""

    name: ClassVar[str] = "yarn"
    factor: float = setting(1.0, arg="rotary_scaling_factor", what="YaRN's scaling factor", mlm=MegatronArg("LB"))
    original_max: int = setting(4096, arg=("yarn_original_max_position_embeddings", "original_max_position_embeddings"),
                                what="YaRN's original context length")
    beta_fast: float = setting(32.0, arg=("yarn_beta_fast", "beta_fast"), what="YaRN's beta_fast")
    beta_slow: float = setting(1.0, arg=("yarn_beta_slow", "beta_slow"), what="YaRN's beta_slow")
    mscale: float = setting(1.0, arg="mscale", what="YaRN's mscale", mlm=MegatronArg("LB"))
    mscale_all_dim: float = setting(0.0, arg="mscale_all_dim", what="YaRN's mscale_all_dim", mlm=MegatronArg("LB"))
    round_to_int: bool = setting(True, arg="yarn_correction_range_round_to_int",
                                 what="YaRN's correction range rounded to whole dimensions")

    @classmethod
    def read(cls, args: dict[str, Any], mla: bool) -> Yarn:
        """YaRN as Megatron-LM's args say it (multi-latent attention's names and defaults when ``mla``)."""
        plain = MLA_YARN if mla else cls()
        return cls(**{name: type(value)(get(args, plain.names(mla)[name], default=value))
                      for name, value, _ in plain.fields()})

    def names(self, mla: bool) -> dict[str, str]:
        """field -> the args name it is written under: multi-latent attention's unprefixed names, else the first."""
        return {f.name: f.metadata["arg"][-1 if mla else 0] for _, _, f in self.fields()}


@dataclass(frozen=True, kw_only=True)
class MLASoftmax(Scaling):
    """Multi-latent attention under plain RoPE still scales its softmax by mscale(factor, mscale_all_dim)^2 from
    YaRN's parameters: kept where that is not 1."""

    name: ClassVar[str] = "mla_softmax"
    factor: float = setting(1.0, arg="rotary_scaling_factor", what="the scaling factor of MLA's softmax scale")
    mscale_all_dim: float = setting(0.0, arg="mscale_all_dim", what="the mscale_all_dim of MLA's softmax scale")


# megatron-core's YaRN under multi-latent attention: MLATransformerConfig's defaults (its rope_type defaults to yarn
# with a factor of 40)
MLA_YARN = Yarn(factor=40.0)


@dataclass(frozen=True, kw_only=True)
class Position(Feature):
    attr: ClassVar[str] = "position"
    essential: ClassVar[tuple[str, ...] | None] = ("kind",)

    kind: str = setting("rope", arg="position_embedding_type",
                        what="position embeddings: rope, yarn, learned_absolute, relative or none",
                        mlm=MegatronArg("LB", MODEL, "learned_absolute"))
    base: float = setting(10000.0, arg="rotary_base", what="the RoPE base (theta)", above=0,
                          mlm=MegatronArg("LB", "", 10000))
    percent: float = setting(1.0, arg="rotary_percent", what="the share of each head RoPE rotates (partial RoPE)",
                             mlm=MegatronArg("LB"))
    interleaved: bool = setting(False, arg="rotary_interleaved", what="interleaved (GPT-J style) RoPE pairs",
                                mlm=MegatronArg("LB"))
    seq_len_interpolation: float | None = setting(None, arg="rotary_seq_len_interpolation_factor",
                                                  config="seq_len_interpolation_factor",
                                                  what="RoPE sequence-length interpolation", mlm=MegatronArg("B"))
    # a record of its own kind (its fields carry their args names); use_rope_scaling says Llama-3's
    scaling: Scaling | None = setting(None, arg="use_rope_scaling", config="rope_scaling", record=Scaling,
                                      what="RoPE frequency scaling (llama3, linear, yarn) or MLA's softmax scale "
                                           "(mla_softmax)",
                                      mlm=MegatronArg("B", "", False))
    local_base: float | None = setting(None, arg="rotary_base_local", above=0,
                                       what="the RoPE base of sliding-window layers (Megatron-Bridge's Gemma 3)")
    mrope_section: tuple[int, ...] | None = setting(None, arg="mrope_section", what="multimodal RoPE sections")
    # megatron-core's MRoPE takes the sections one after the other; Megatron-Bridge's Qwen3-VL model interleaves them
    # (transformers' apply_interleaved_mrope): a setting of its own, written only by dist_convert
    mrope_interleaved: bool = setting(False, arg="mrope_interleaved", config=(),
                                      what="interleaved multimodal RoPE sections (Qwen3-VL)")
    no_rope_freq: Any = setting(None, arg="no_rope_freq", what="layers without RoPE (no_rope_freq)")
    # Llama 4's attention temperature, as Ministral 3 applies it with YaRN: queries scaled by
    # 1 + beta * log(1 + floor(position / YaRN's original length)); megatron-core has none (Megatron-Bridge's
    # Ministral 3 attention applies it)
    query_scale_beta: float = setting(0.0, arg="llama_4_scaling_beta", config=(),
                                      what="Llama-4 query scaling by position (its beta; Ministral 3, with YaRN)")
    mla_names: bool = setting(False, kind=LAYOUT, arg="rope_type",
                              what="YaRN written as multi-latent attention's rope_type (else position_embedding_type)",
                              mlm=MegatronArg("LB", "", None))

    def __post_init__(self) -> None:
        super().__post_init__()
        s = self.scaling
        fits = {Yarn: self.kind == "yarn", MLASoftmax: self.kind == "rope" and self.mla_names,
                Llama3: self.kind == "rope", Linear: self.kind == "rope"}
        if self.query_scale_beta and not isinstance(s, Yarn):
            raise ConvertError(f"llama_4_scaling_beta={self.query_scale_beta} without YaRN: the query scaling counts "
                               "positions in YaRN's original length", "correct the source's RoPE settings")
        if (self.kind == "yarn") != isinstance(s, Yarn) or s is not None and not fits[type(s)]:
            raise ConvertError(f"position_embedding_type={self.kind} with {s.name if s else 'no'} RoPE scaling: "
                               "megatron-core builds no such position embedding",
                               "correct the source's RoPE settings (YaRN's parameters go with position type yarn)")

    @property
    def rope(self) -> bool:
        """RoPE of any flavour (YaRN included)."""
        return self.kind in ("rope", "yarn", "mrope")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Position:
        a = vars(args)
        kind = str(get(a, "position_embedding_type", default="learned_absolute"))
        if kind not in KINDS:
            raise ConvertError(f"position_embedding_type={kind}: megatron-core builds no such position embedding",
                               f"convert a model whose positions are one of {', '.join(KINDS)}")
        mla = bool(get(a, "multi_latent_attention", default=False))
        if mla:  # MLA's own rope_type (MLATransformerConfig defaults to yarn when args leave it unset)
            kind = "yarn" if get(a, "rope_type", default="yarn") == "yarn" else "rope"
        out: dict[str, Any] = {"kind": kind, "mla_names": mla}
        if kind in ("rope", "yarn", "mrope"):
            out.update(base=float(get(a, "rotary_base", default=10000)),
                       percent=float(get(a, "rotary_percent", default=1.0)),
                       interleaved=bool(get(a, "rotary_interleaved", default=False)),
                       seq_len_interpolation=_float(get(a, "rotary_seq_len_interpolation_factor")),
                       mrope_section=as_tuple(get(a, "mrope_section")),
                       mrope_interleaved=bool(get(a, "mrope_interleaved", default=False)),
                       no_rope_freq=as_tuple(get(a, "no_rope_freq")),
                       query_scale_beta=float(get(a, "llama_4_scaling_beta", default=0.0)))
            local = get(a, "rotary_base_local")
            factor = _float(get(a, "rope_scaling_factor"))
            llama3 = bool(get(a, "use_rope_scaling", default=False))
            if local is not None and not llama3:  # Megatron-Bridge's Gemma 3: the factor scales the global layers
                out.update(local_base=float(local))
            scalings: list[Scaling] = [Yarn.read(a, mla)] if kind == "yarn" else []
            if llama3:
                scalings.append(Llama3(factor=factor or LLAMA3_DEFAULT_FACTOR))
            elif local is not None and factor not in (None, 1.0):
                scalings.append(Linear(factor=factor))
            if mla and kind == "rope":  # MLA's softmax scale from YaRN's parameters: kept where it is not 1
                mla_factor = float(get(a, "rotary_scaling_factor", default=MLA_YARN.factor))
                all_dim = float(get(a, "mscale_all_dim", default=MLA_YARN.mscale_all_dim))
                if mla_factor > 1 and all_dim:
                    scalings.append(MLASoftmax(factor=mla_factor, mscale_all_dim=all_dim))
            if len(scalings) > 1:
                raise ConvertError(f"the args give RoPE {' and '.join(s.name for s in scalings)} scaling at once "
                                   "(use_rope_scaling, rope_scaling_factor with rotary_base_local, YaRN's "
                                   "rotary_scaling_factor): megatron-core applies one of them",
                                   "correct the source's RoPE settings to the one its model applies")
            if scalings:
                out.update(scaling=scalings[0])
        return cls(**out)

    def to_args(self) -> dict[str, Any]:
        rope, s = self.rope, self.scaling
        out: dict[str, Any] = {
            "position_embedding_type": "rope" if self.mla_names else self.kind,
            "use_rotary_position_embeddings": self.kind == "rope",
            "rotary_base": self.base if rope else 10000, "rotary_percent": self.percent,
            "rotary_interleaved": self.interleaved, "rotary_seq_len_interpolation_factor": self.seq_len_interpolation,
            "use_rope_scaling": isinstance(s, Llama3),
            # Megatron-LM's default is Llama-3's 8; with a local base (Megatron-Bridge's Gemma 3) the factor scales the
            # global layers linearly, so an unscaled one writes 1
            "rope_scaling_factor": 1.0 if self.local_base is not None else LLAMA3_DEFAULT_FACTOR,
        }
        if self.mla_names:
            out["rope_type"] = "yarn" if self.kind == "yarn" else "rope"
        for name, value in (("rotary_base_local", self.local_base), ("mrope_section", self.mrope_section),
                            ("no_rope_freq", self.no_rope_freq)):
            if value is not None:
                out[name] = list(value) if isinstance(value, tuple) else value
        if self.mrope_interleaved:
            out["mrope_interleaved"] = True
        if self.query_scale_beta:
            out["llama_4_scaling_beta"] = self.query_scale_beta
        if isinstance(s, Yarn):
            out.update({s.names(self.mla_names)[name]: value for name, value, _ in s.fields()})
        elif s is not None:
            out.update(s.to_args())
        return out


def _float(value: Any) -> float | None:
    return None if value is None else float(value)
