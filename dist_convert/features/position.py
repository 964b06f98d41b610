"""Positional encoding: the kind (RoPE, YaRN, learned absolute, T5's relative buckets, none) and every RoPE
setting megatron-core applies (base, rotated share, interleaving, sequence-length interpolation, Llama-3 and
linear frequency scaling, YaRN's parameters, Gemma 3's local base, layers without RoPE)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, ClassVar

from ..errors import ConvertError
from .base import LAYOUT, MODEL, Feature, MegatronArg, as_tuple, get, setting

# megatron-core's YaRN defaults: MLATransformerConfig's for multi-latent attention (its rope_type defaults to yarn
# with a factor of 40), Megatron-LM's _apply_yarn_config_from_args for GPT attention
MLA_YARN = {"factor": 40.0, "original_max": 4096, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
            "mscale_all_dim": 0.0}
GPT_YARN = {"factor": 1.0, "original_max": 4096, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
            "mscale_all_dim": 0.0}
# the position embeddings megatron-core's models build (relative: T5's)
KINDS = ("rope", "yarn", "mrope", "learned_absolute", "relative", "none")
LLAMA3_DEFAULT_FACTOR = 8.0  # Megatron-LM's --rope-scaling-factor default


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
    scaling: str | None = setting(None, arg="use_rope_scaling", config="rope_scaling",
                                  what="RoPE frequency scaling: llama3, or linear (Gemma 3's global layers)",
                                  mlm=MegatronArg("B", "", False))
    scaling_factor: float | None = setting(None, arg="rope_scaling_factor", what="the RoPE scaling factor",
                                           mlm=MegatronArg("B", "", LLAMA3_DEFAULT_FACTOR))
    yarn_factor: float | None = setting(None, arg="rotary_scaling_factor", what="YaRN's scaling factor",
                                        mlm=MegatronArg("LB", "", 1.0))
    yarn_original_max: int | None = setting(None, arg=("yarn_original_max_position_embeddings",
                                                       "original_max_position_embeddings"),
                                            what="YaRN's original context length")
    yarn_beta_fast: float | None = setting(None, arg=("yarn_beta_fast", "beta_fast"), what="YaRN's beta_fast")
    yarn_beta_slow: float | None = setting(None, arg=("yarn_beta_slow", "beta_slow"), what="YaRN's beta_slow")
    yarn_mscale: float | None = setting(None, arg="mscale", what="YaRN's mscale", mlm=MegatronArg("LB", "", 1.0))
    yarn_mscale_all_dim: float | None = setting(None, arg="mscale_all_dim", what="YaRN's mscale_all_dim",
                                                mlm=MegatronArg("LB", "", 0.0))
    yarn_round_to_int: bool | None = setting(None, arg="yarn_correction_range_round_to_int",
                                             what="YaRN's correction range rounded to whole dimensions")
    local_base: float | None = setting(None, arg="rotary_base_local", above=0,
                                       what="the RoPE base of sliding-window layers (Megatron-Bridge's Gemma 3)")
    mrope_section: tuple[int, ...] | None = setting(None, arg="mrope_section", what="multimodal RoPE sections")
    # megatron-core's MRoPE takes the sections one after the other; Megatron-Bridge's Qwen3-VL model interleaves them
    # (transformers' apply_interleaved_mrope): a setting of its own, written only by dist_convert
    mrope_interleaved: bool = setting(False, arg="mrope_interleaved", config=(),
                                      what="interleaved multimodal RoPE sections (Qwen3-VL)")
    no_rope_freq: Any = setting(None, arg="no_rope_freq", what="layers without RoPE (no_rope_freq)")
    mla_names: bool = setting(False, kind=LAYOUT, arg="rope_type",
                              what="YaRN written as multi-latent attention's rope_type (else position_embedding_type)",
                              mlm=MegatronArg("LB", "", None))

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
        rope = kind in ("rope", "yarn", "mrope")
        out: dict[str, Any] = {"kind": kind, "mla_names": mla}
        if rope:
            out.update(base=float(get(a, "rotary_base", default=10000)),
                       percent=float(get(a, "rotary_percent", default=1.0)),
                       interleaved=bool(get(a, "rotary_interleaved", default=False)),
                       seq_len_interpolation=_float(get(a, "rotary_seq_len_interpolation_factor")),
                       mrope_section=as_tuple(get(a, "mrope_section")),
                       mrope_interleaved=bool(get(a, "mrope_interleaved", default=False)),
                       no_rope_freq=as_tuple(get(a, "no_rope_freq")))
            local = get(a, "rotary_base_local")
            factor = _float(get(a, "rope_scaling_factor"))
            if get(a, "use_rope_scaling", default=False):
                out.update(scaling="llama3", scaling_factor=factor or LLAMA3_DEFAULT_FACTOR)
            elif local is not None:  # Megatron-Bridge's Gemma 3: the factor scales the global layers linearly
                out.update(local_base=float(local))
                if factor not in (None, 1.0):
                    out.update(scaling="linear", scaling_factor=factor)
        if mla and kind == "rope":  # MLA scales its softmax by mscale(rotary_scaling_factor, mscale_all_dim)^2 even
            # under plain RoPE: kept where that is not 1
            factor = float(get(a, "rotary_scaling_factor", default=MLA_YARN["factor"]))
            all_dim = float(get(a, "mscale_all_dim", default=MLA_YARN["mscale_all_dim"]))
            if factor > 1 and all_dim:
                out.update(yarn_factor=factor, yarn_mscale_all_dim=all_dim)
        if kind == "yarn":
            defaults = MLA_YARN if mla else GPT_YARN
            out.update(
                yarn_factor=float(get(a, "rotary_scaling_factor", default=defaults["factor"])),
                yarn_original_max=int(get(a, "original_max_position_embeddings" if mla else
                                          "yarn_original_max_position_embeddings", default=defaults["original_max"])),
                yarn_beta_fast=float(get(a, "beta_fast" if mla else "yarn_beta_fast", default=defaults["beta_fast"])),
                yarn_beta_slow=float(get(a, "beta_slow" if mla else "yarn_beta_slow", default=defaults["beta_slow"])),
                yarn_mscale=float(get(a, "mscale", default=defaults["mscale"])),
                yarn_mscale_all_dim=float(get(a, "mscale_all_dim", default=defaults["mscale_all_dim"])),
                yarn_round_to_int=bool(get(a, "yarn_correction_range_round_to_int", default=True)))
        return cls(**out)

    def to_args(self) -> dict[str, Any]:
        rope = self.rope
        out: dict[str, Any] = {
            "position_embedding_type": "rope" if self.mla_names else self.kind,
            "use_rotary_position_embeddings": self.kind == "rope",
            "rotary_base": self.base if rope else 10000, "rotary_percent": self.percent,
            "rotary_interleaved": self.interleaved, "rotary_seq_len_interpolation_factor": self.seq_len_interpolation,
            "use_rope_scaling": self.scaling == "llama3",
            # Megatron-LM's default is Llama-3's 8; with a local base (Megatron-Bridge's Gemma 3) the factor scales the
            # global layers linearly, so an unscaled one writes 1
            "rope_scaling_factor": self.scaling_factor if self.scaling else
            (1.0 if self.local_base is not None else LLAMA3_DEFAULT_FACTOR),
        }
        if self.mla_names:
            out["rope_type"] = "yarn" if self.kind == "yarn" else "rope"
        for name, value in (("rotary_base_local", self.local_base), ("mrope_section", self.mrope_section),
                            ("no_rope_freq", self.no_rope_freq)):
            if value is not None:
                out[name] = list(value) if isinstance(value, tuple) else value
        if self.mrope_interleaved:
            out["mrope_interleaved"] = True
        if self.scaling == "linear":
            out["rope_scaling_factor"] = self.scaling_factor
        if self.kind == "rope" and self.yarn_factor is not None:
            out.update(rotary_scaling_factor=self.yarn_factor, mscale_all_dim=self.yarn_mscale_all_dim)
        if self.kind == "yarn":
            out.update(rotary_scaling_factor=self.yarn_factor, mscale=self.yarn_mscale,
                       mscale_all_dim=self.yarn_mscale_all_dim,
                       yarn_correction_range_round_to_int=self.yarn_round_to_int)
            prefix = "" if self.mla_names else "yarn_"
            out.update({f"{prefix}beta_fast": self.yarn_beta_fast, f"{prefix}beta_slow": self.yarn_beta_slow,
                        ("original_max_position_embeddings" if self.mla_names else
                         "yarn_original_max_position_embeddings"): self.yarn_original_max})
        return out


def _float(value: Any) -> float | None:
    return None if value is None else float(value)
