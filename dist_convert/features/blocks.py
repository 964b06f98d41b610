"""The structural features: multi-latent attention and its DeepSeek sparse attention, multi-token prediction,
Mamba2 hybrid stacks, Gated DeltaNet layers and T5's encoder-decoder. Each is present (a record) or absent (None on
``ModelConfig``)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from ..errors import ConvertError
from .base import LAYOUT, MODEL, NUMERICS, SIZE, Feature, MegatronArg, get, layout_flag, setting

if TYPE_CHECKING:
    from ..config import ModelConfig
    from ..layout.topology import Layout

# MambaModel's layer symbols -> (mixer, MLP) of the layer (megatron-core's hybrid layer allocation)
HYBRID_SYMBOLS: dict[str, tuple[str | None, str | None]] = {
    "M": ("mamba", None), "G": ("gdn", None), "*": ("attention", None), "+": ("attention", None),
    "D": ("attention", None), "-": (None, "dense"), "E": (None, "moe")}
GDN_SYMBOL = "G"  # a HybridModel's Gated DeltaNet layer (its sizes: the GDN record)
MTP_SEPARATOR = "/"  # a HybridModel pattern's multi-token-prediction depths follow the main pattern after it
MLA_SYMBOL = "+"  # a HybridModel's multi-latent attention layer (the MLA record; ``*`` is plain attention)
DSA_SYMBOL = "D"  # a HybridModel's DeepSeek-sparse-attention layer (MLA with an indexer: the MLA and DSA records)


def hybrid_pattern_parts(a: dict[str, Any]) -> tuple[str, list[str]]:
    """A HybridModel's args pattern as (its main part, its multi-token-prediction depths' parts after ``/``); ("", [])
    for a GPTModel's args."""
    main, *depths = str(get(a, "hybrid_layer_pattern", "hybrid_override_pattern") or "").split(MTP_SEPARATOR)
    return main, depths


def attention_symbol(cfg: ModelConfig) -> str:
    """The hybrid pattern's symbol of the model's attention layers: ``D`` DSA, ``+`` MLA, ``*`` attention."""
    return DSA_SYMBOL if cfg.dsa is not None else MLA_SYMBOL if cfg.mla is not None else "*"


@dataclass(frozen=True, kw_only=True)
class MLA(Feature):
    """megatron-core's MLASelfAttention (DeepSeek-V2/V3): the model's kv_channels is unused then."""

    attr: ClassVar[str] = "mla"
    what: ClassVar[str] = "multi-latent attention"
    presence: ClassVar[tuple[str, ...]] = ("multi_latent_attention",)

    q_lora_rank: int | None = setting(None, kind=SIZE, arg="q_lora_rank",
                                      what="the query down-projection rank (None: one linear_q_proj)",
                                      mlm=MegatronArg("LB", MODEL))
    kv_lora_rank: int = setting(32, kind=SIZE, arg="kv_lora_rank", what="the compressed key/value rank",
                                mlm=MegatronArg("LB", MODEL))
    qk_head_dim: int = setting(128, kind=SIZE, arg="qk_head_dim", what="per-head query/key size without RoPE",
                               mlm=MegatronArg("LB", MODEL))
    qk_pos_emb_head_dim: int = setting(64, kind=SIZE, arg="qk_pos_emb_head_dim", what="per-head RoPE size",
                                       mlm=MegatronArg("LB", MODEL))
    v_head_dim: int = setting(128, kind=SIZE, arg="v_head_dim", what="per-head value size",
                              mlm=MegatronArg("LB", MODEL))
    # the local spec (and Transformer Engine specs before the ``duplicated`` TELinear) split the down-projections
    # over TP instead of replicating them
    down_split: bool = setting(False, kind=LAYOUT, arg=(), what="down-projections split over TP")

    @property
    def q_head_dim(self) -> int:
        return self.qk_head_dim + self.qk_pos_emb_head_dim

    @classmethod
    def from_args(cls, args: argparse.Namespace, spec: str = "te") -> MLA | None:
        if not get(vars(args), "multi_latent_attention", default=False):
            return None
        values = cls.args_values(args)
        return cls(**{**values, "q_lora_rank": values["q_lora_rank"] or None, "down_split": spec == "local"})

    def to_args(self) -> dict[str, Any]:
        return {"multi_latent_attention": True, **super().to_args()}

    def check_layout(self, cfg: ModelConfig, layout: Layout, what: str) -> None:
        """Down-projections split over TP (``down_split``) split by whole rows."""
        if not self.down_split:
            return
        for name, n in (("q_lora_rank", self.q_lora_rank or 0),
                        ("kv_lora_rank + qk_pos_emb_head_dim", self.kv_lora_rank + self.qk_pos_emb_head_dim)):
            if n % layout.tp:
                raise ConvertError(f"{what} TP={layout.tp} does not divide {name}={n}: the {cfg.spec} spec splits "
                                   "MLA's down-projections over TP",
                                   f"choose {layout_flag(what)} among the divisors of {n}, or --target-spec te "
                                   "(which replicates them)")

    @staticmethod
    def absent_args() -> dict[str, Any]:
        return {"multi_latent_attention": False}


DSA_VARIANT = "dsa"


@dataclass(frozen=True, kw_only=True)
class DSA(Feature):
    """megatron-core's DeepSeek Sparse Attention (``experimental_attention_variant`` "dsa"; GLM-5, DeepSeek-V3.2): MLA
    whose core attention reads only the top-k keys a lightning indexer scores per query. The indexer (its q from the
    MLA's normalised q latent, one shared key per token through a LayerNorm, RoPE on the first qk_pos_emb_head_dim
    features, ReLU'd dot products weighted per head) is replicated over TP. With ``topk_freq`` > 1 only computing layers
    have an indexer; the others reuse the top-k of the last computing layer (1-based layer L computes iff
    max(L - max(offset, 1), 0) % topk_freq == 0; an MTP layer counts its own layers from 1)."""

    attr: ClassVar[str] = "dsa"
    te2_spec: ClassVar[bool] = True
    what: ClassVar[str] = "DeepSeek sparse attention (a top-k indexer)"

    n_heads: int = setting(64, kind=SIZE, arg="dsa_indexer_n_heads", what="indexer heads", low=1)
    head_dim: int = setting(128, kind=SIZE, arg="dsa_indexer_head_dim", what="indexer head size", low=1)
    topk: int = setting(2048, arg="dsa_indexer_topk", what="the keys each query attends to (the indexer's top-k)",
                        low=1)
    topk_freq: int = setting(1, arg="dsa_indexer_topk_freq", what="layers per indexer (1: every layer its own top-k)",
                             low=1)
    skip_topk_offset: int = setting(0, arg="dsa_indexer_skip_topk_offset",
                                    what="where top-k sharing starts (with topk_freq > 1; 0 and 1 alike)")
    rope_interleaved: bool = setting(False, arg="dsa_indexer_rope_interleaved",
                                     what="interleaved (MLA-style) RoPE in the indexer instead of rotate-half")
    scoring_relu: bool = setting(True, arg="dsa_indexer_scoring_relu", what="ReLU on the indexer's q.k scores")
    k_norm_eps: float | None = setting(None, arg="dsa_indexer_k_norm_epsilon",
                                       what="the indexer key LayerNorm's epsilon (None: the norm epsilon)")
    # an orthonormal (Hadamard) rotation of the indexer's q and k: dot products are kept, only rounding differs
    rotate_activation: bool = setting(True, kind=NUMERICS, arg="dsa_indexer_rotate_activation",
                                      what="a Hadamard rotation of the indexer's q and k")
    k_norm_fp32: bool = setting(False, kind=NUMERICS, arg="dsa_indexer_k_norm_fp32",
                                what="the indexer key LayerNorm in fp32")

    def computes_topk(self, layer: int) -> bool:
        """Whether 0-based layer ``layer`` (of the decoder, or of the MTP block) has an indexer of its own."""
        return self.topk_freq == 1 or max(layer + 1 - max(self.skip_topk_offset, 1), 0) % self.topk_freq == 0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DSA | None:
        a = vars(args)
        if get(a, "experimental_attention_variant") != DSA_VARIANT:
            return None
        values = cls.args_values(args)
        eps = get(a, "dsa_indexer_k_norm_epsilon", "layernorm_epsilon", "norm_epsilon", default=1e-5)
        # megatron-core counts offsets below 1 as 1, and none matters when every layer computes
        offset = max(values["skip_topk_offset"], 1) if values["topk_freq"] > 1 else 0
        return cls(**{**values, "skip_topk_offset": offset, "k_norm_eps": float(eps)})

    def to_args(self) -> dict[str, Any]:
        return {"experimental_attention_variant": DSA_VARIANT, **super().to_args()}

    def check_layout(self, cfg: ModelConfig, layout: Layout, what: str) -> None:
        """megatron-core builds DeepSeek sparse attention with Transformer Engine's spec only, over MLA, and shares a
        top-k only within a pipeline chunk (the experimental spec raises when a chunk starts on a sharing layer)."""
        if cfg.mla is None:
            raise ConvertError(f"{what}: DeepSeek sparse attention without multi-latent attention; megatron-core's "
                               "DSA spec is MLA's", "convert a model with multi_latent_attention set")
        if cfg.spec != "te":
            raise ConvertError(f"{what}: megatron-core builds DeepSeek sparse attention with Transformer Engine's "
                               f"layer spec only, not {cfg.spec}", "drop --target-spec local")
        if self.topk_freq == 1:
            return
        for p, v, first, n in layout.model_chunks(cfg.num_layers):
            if n and not self.computes_topk(first):
                raise ConvertError(f"{what} {layout} starts pipeline chunk (pp {p}, vpp {v}) on layer {first}, which "
                                   f"reuses the top-k of an earlier layer (dsa_indexer_topk_freq={self.topk_freq}); "
                                   "megatron-core shares top-k only within a chunk",
                                   f"choose {layout_flag(what, '--target-pp / --target-num-layers-in-first-stage')} "
                                   "so that every stage starts on a layer with an indexer")


@dataclass(frozen=True, kw_only=True)
class MTP(Feature):
    """megatron-core's MultiTokenPredictionBlock: layers built like the last decoder layer."""

    attr: ClassVar[str] = "mtp"
    what: ClassVar[str] = "multi-token-prediction layers"

    num_layers: int = setting(1, kind=SIZE, arg="mtp_num_layers", what="multi-token-prediction layers",
                              mlm=MegatronArg("LB", MODEL, None))

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> MTP | None:
        """``mtp_num_layers``, or a HybridModel's depth count: its pattern's parts after ``/``."""
        a = vars(args)
        n = int(get(a, "mtp_num_layers", default=0) or 0) or len(hybrid_pattern_parts(a)[1])
        return cls(num_layers=n) if n else None

    @staticmethod
    def absent_args() -> dict[str, Any]:
        return {"mtp_num_layers": None}


@dataclass(frozen=True, kw_only=True)
class Mamba(Feature):
    """megatron-core's MambaModel (Nemotron-H): one symbol per layer, "M" Mamba2 mixer, "*" attention, "-" MLP,
    "E" MoE (hybrid_override_pattern / hybrid_layer_pattern); its final norm is decoder.final_norm."""

    attr: ClassVar[str] = "mamba"
    what: ClassVar[str] = "a HybridModel layer stack (its hybrid pattern: MambaModel, HybridModel)"
    presence: ClassVar[tuple[str, ...]] = ("is_hybrid_model",)

    pattern: str = setting("", kind=SIZE, arg=("hybrid_override_pattern", "hybrid_layer_pattern"),
                           what="the hybrid layer pattern",
                           mlm=(MegatronArg("LRB", "", None), MegatronArg("LR", "", None)))
    num_heads: int = setting(0, kind=SIZE, arg="mamba_num_heads", what="Mamba2 heads", mlm=MegatronArg("L", "", None))
    head_dim: int = setting(64, kind=SIZE, arg="mamba_head_dim", what="Mamba2 head size", mlm=MegatronArg("L"))
    num_groups: int = setting(8, kind=SIZE, arg="mamba_num_groups", what="Mamba2 B/C groups", mlm=MegatronArg("L"))
    state_dim: int = setting(128, kind=SIZE, arg="mamba_state_dim", what="Mamba2 state size", mlm=MegatronArg("L"))
    layer_pattern_name: bool = setting(False, kind=LAYOUT, arg=(),
                                       what="the pattern written as megatron-core 0.19's hybrid_layer_pattern too")
    mtp_pattern: str = setting("", kind=SIZE, arg=(), what="the multi-token-prediction depths' layer patterns (after "
                               "the first '/' of the pattern, '/' between depths)")
    pipes: bool = setting(False, kind=LAYOUT, arg=(), what="pipeline stages marked in the pattern by '|' "
                          "(megatron-core >= 0.19): kept so at PP > 1")

    @property
    def d_inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def full_pattern(self) -> str:
        """The main pattern and its multi-token-prediction depths (megatron-core 0.19's unified ``main/mtp/mtp``)."""
        return self.pattern + (MTP_SEPARATOR + self.mtp_pattern if self.mtp_pattern else "")

    @property
    def sections(self) -> tuple[tuple[str, int], ...]:
        """Mamba2 ``in_proj`` rows: [z | x | B | C | dt], each split over TP on its own."""
        gn = self.num_groups * self.state_dim
        return (("z", self.d_inner), ("x", self.d_inner), ("B", gn), ("C", gn), ("dt", self.num_heads))

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Mamba | None:
        a = vars(args)
        main, depths = hybrid_pattern_parts(a)
        if not main:
            return None
        legacy = get(a, "mtp_hybrid_override_pattern")  # megatron-core <= 0.18: one depth's, mtp_num_layers times
        if not depths and legacy:
            depths = [str(legacy)] * int(get(a, "mtp_num_layers", default=1) or 1)
        values = cls.args_values(args)
        heads = values["num_heads"] or 2 * int(a["hidden_size"]) // values["head_dim"]
        return cls(**{**values, "pattern": hybrid_pattern_of(main, int(a["num_layers"])), "num_heads": heads,
                      "layer_pattern_name": bool(get(a, "hybrid_layer_pattern")), "pipes": "|" in main,
                      "mtp_pattern": MTP_SEPARATOR.join(hybrid_pattern_of(d) for d in depths)})

    def shown(self) -> list[str]:
        """The Mamba2 sizes only where the pattern has Mamba2 layers (they size nothing else)."""
        return super().shown() if "M" in self.pattern else ["pattern"] + (["mtp_pattern"] if self.mtp_pattern else [])

    def to_args(self) -> dict[str, Any]:
        """The pattern with its multi-token-prediction depths (megatron-core 0.19's unified ``main/mtp/mtp``, whose
        depth count Megatron-LM checks against ``mtp_num_layers``)."""
        out = {"is_hybrid_model": True, **super().to_args()}
        if self.mtp_pattern:
            for name in ("hybrid_override_pattern", "hybrid_layer_pattern"):
                out[name] = self.full_pattern
        if not self.layer_pattern_name:  # megatron-core 0.19's name only where the source used it
            del out["hybrid_layer_pattern"]
        return out

    @staticmethod
    def absent_args() -> dict[str, Any]:
        """A GPTModel's args (a HybridModel source written as GPT): Megatron-LM builds a hybrid model from either
        pattern field."""
        return {"is_hybrid_model": False, "hybrid_override_pattern": None, "hybrid_layer_pattern": None}

    def piped(self, layout: Layout) -> bool:
        """Whether the target's pattern marks its pipeline stages by ``|``: where only they say the stages (virtual
        stages, a layout string) or the source's did; else megatron-core splits the pattern (0.16's MambaModel reads
        no ``|``; 0.19 splits evenly or by the first / last stage sizes)."""
        return layout.pp > 1 and bool(layout.vpp or layout.pipeline_layout or self.pipes)

    def layout_args(self, cfg: ModelConfig, layout: Layout) -> dict[str, Any]:
        """A piped target (``piped``): the pattern with a ``|`` between stages (each model chunk's layers, VPP-major)
        and no other stage field (Megatron-LM refuses them beside ``|`` and derives VPP from the segments)."""
        if not self.piped(layout):
            return {}
        main, out = [], 0
        for n in layout.segment_sizes(cfg.num_layers):
            main.append(self.pattern[out:out + n])
            out += n
        pattern = "|".join(main) + (MTP_SEPARATOR + self.mtp_pattern if self.mtp_pattern else "")
        return {"hybrid_override_pattern": pattern, **({"hybrid_layer_pattern": pattern} if self.layer_pattern_name
                                                       else {}),
                "decoder_first_pipeline_num_layers": None, "decoder_last_pipeline_num_layers": None,
                "pipeline_model_parallel_layout": None, "num_layers_per_virtual_pipeline_stage": None,
                "num_virtual_stages_per_pipeline_rank": None}

    def check_layout(self, cfg: ModelConfig, layout: Layout, what: str) -> None:
        """megatron-core splits a Mamba2 mixer by whole heads and groups (MambaMixer asserts it); a HybridModel builds
        its multi-token-prediction depths on the last stage; the attention layers are all of the model's kind
        (``attention_symbol``)."""
        depths = self.mtp_pattern.count(MTP_SEPARATOR) + 1 if self.mtp_pattern else 0
        if depths != cfg.mtp_num_layers:
            raise ConvertError(f"hybrid layer pattern {self.pattern}/{self.mtp_pattern}: {depths} multi-token-"
                               f"prediction depths after '/', but mtp_num_layers is {cfg.mtp_num_layers}",
                               "fix mtp_num_layers or the pattern in the checkpoint args")
        own = attention_symbol(cfg)
        other = sorted({"*", MLA_SYMBOL, DSA_SYMBOL} - {own} & set(self.pattern + self.mtp_pattern))
        if other:
            raise ConvertError(f"hybrid layer pattern {self.pattern!r} has {' '.join(other)} layers, but the model's "
                               f"attention layers are {own} (multi_latent_attention={cfg.mla is not None}, "
                               f"experimental_attention_variant={'dsa' if cfg.dsa else None}): dist_convert converts "
                               "a hybrid model whose attention layers are all of one kind",
                               "fix multi_latent_attention / experimental_attention_variant or the pattern in the "
                               "checkpoint args")
        split_by_heads(layout, what, (("mamba_num_heads", self.num_heads), ("mamba_num_groups", self.num_groups)))
        if cfg.spec != "te":
            raise ConvertError(f"{what}: megatron-core builds a HybridModel (MambaModel) with Transformer Engine's "
                               f"layer spec only, not {cfg.spec}", "drop --target-spec local")
        if self.mtp_pattern and layout.stages_holding("m") != layout.stages_holding("L"):
            raise ConvertError(f"{what} pipeline layout {layout.pipeline_layout!r} puts the multi-token-prediction "
                               "depths (m) on another stage than the loss (L); a HybridModel builds them on the last "
                               "stage", "move every m into the last stage, before L, in --target-pipeline-layout")


def split_by_heads(layout: Layout, what: str, counts: tuple[tuple[str, int], ...]) -> None:
    """A linear-time mixer's heads and groups, each split over TP whole."""
    for name, n in counts:
        if n % layout.tp:
            raise ConvertError(f"{what} TP={layout.tp} does not divide {name}={n}: megatron-core splits the mixer by "
                               "whole heads and groups", f"choose {layout_flag(what)} among the divisors of {n}")


def hybrid_pattern_of(pattern: str, num_layers: int | None = None) -> str:
    """The per-layer symbols of megatron-core's hybrid layer pattern (pipeline splits ``|`` dropped); refused in one
    line when a symbol is one megatron-core's MambaModel does not build here, or the count disagrees."""
    symbols = pattern.replace("|", "")
    bad = sorted(set(symbols) - set(HYBRID_SYMBOLS))
    if bad or not symbols:
        raise ConvertError(f"hybrid layer pattern {pattern!r} has symbol(s) {''.join(bad) or 'none'}: megatron-core's "
                           "HybridModel layers converted here are M (Mamba2), G (Gated DeltaNet), * (attention), "
                           "+ (multi-latent attention), D (DeepSeek sparse attention), - (MLP) and E (MoE)",
                           "convert a model whose hybrid_override_pattern uses only M, G, *, +, D, - and E (and "
                           "multi-token-prediction depths after '/')")
    if num_layers is not None and len(symbols) != num_layers:
        raise ConvertError(f"hybrid layer pattern {pattern!r} has {len(symbols)} layers but num_layers is {num_layers}",
                           "fix num_layers or the pattern in the checkpoint args")
    return symbols


@dataclass(frozen=True, kw_only=True)
class GDN(Feature):
    """GPTModel with Gated DeltaNet layers (experimental_attention_variant "gated_delta_net"; Qwen3-Next/3.5)."""

    attr: ClassVar[str] = "gdn"
    te2_spec: ClassVar[bool] = True
    what: ClassVar[str] = "Gated DeltaNet layers"
    presence: ClassVar[tuple[str, ...]] = ("experimental_attention_variant",)

    pattern: tuple[int, ...] = setting((), kind=SIZE, arg="linear_attention_freq",
                                       what="1 per Gated DeltaNet layer, 0 per full-attention layer")
    num_key_heads: int = setting(16, kind=SIZE, arg="linear_num_key_heads", what="key heads")
    num_value_heads: int = setting(32, kind=SIZE, arg="linear_num_value_heads", what="value heads")
    key_head_dim: int = setting(128, kind=SIZE, arg="linear_key_head_dim", what="key head size")
    value_head_dim: int = setting(128, kind=SIZE, arg="linear_value_head_dim", what="value head size")
    conv_kernel_dim: int = setting(4, kind=SIZE, arg="linear_conv_kernel_dim", what="the short convolution's width")

    @property
    def sections(self) -> tuple[tuple[str, int], ...]:
        """Gated DeltaNet ``in_proj`` rows: [query | key | value | z | beta | alpha], each split over TP on its own."""
        qk = self.num_key_heads * self.key_head_dim
        vd = self.num_value_heads * self.value_head_dim
        nv = self.num_value_heads
        return (("query", qk), ("key", qk), ("value", vd), ("z", vd), ("beta", nv), ("alpha", nv))

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> GDN | None:
        """GPTModel's Gated DeltaNet layers (``experimental_attention_variant``), or a HybridModel's ``G`` layers,
        whose pattern says where they are (1 per ``G``)."""
        a = vars(args)
        variant = get(a, "experimental_attention_variant")
        hybrid = hybrid_pattern_parts(a)[0]  # the decoder's layers (an MTP depth is built like the last)
        if variant is None and GDN_SYMBOL in hybrid:
            symbols = hybrid_pattern_of(hybrid, int(a["num_layers"]))
            return cls(**{**cls.args_values(args), "pattern": tuple(int(c == GDN_SYMBOL) for c in symbols)})
        if variant is None or variant == DSA_VARIANT:
            return None
        if variant != "gated_delta_net":
            raise ConvertError(f"experimental_attention_variant={variant!r}: the variants converted here are "
                               f"gated_delta_net and {DSA_VARIANT}", "convert a model of a supported layer kind")
        pattern = linear_attention_pattern(get(a, "linear_attention_freq"), int(a["num_layers"]))
        return cls(**{**cls.args_values(args), "pattern": pattern})

    def to_args(self) -> dict[str, Any]:
        return {"experimental_attention_variant": "gated_delta_net", **super().to_args(),
                "linear_attention_freq": linear_attention_freq(self.pattern)}

    def check_layout(self, cfg: ModelConfig, layout: Layout, what: str) -> None:
        """megatron-core splits a Gated DeltaNet by whole key and value heads (TransformerConfig asserts it)."""
        split_by_heads(layout, what, (("linear_num_key_heads", self.num_key_heads),
                                      ("linear_num_value_heads", self.num_value_heads)))


def linear_attention_freq(pattern: tuple[int, ...]) -> int | list[int]:
    """The inverse of :func:`linear_attention_pattern`: N when every N-th layer is full attention, else the 0/1 list."""
    if 0 in pattern:
        n = pattern.index(0) + 1
        if pattern == tuple(0 if (i + 1) % n == 0 else 1 for i in range(len(pattern))):
            return n
    return list(pattern)


def linear_attention_pattern(freq: Any, num_layers: int) -> tuple[int, ...]:
    """megatron-core's ``linear_attention_freq``: an int N (layer i, 0-based, is full attention iff (i + 1) % N == 0,
    the others Gated DeltaNet) or a 0/1 list (1 = linear attention)."""
    if isinstance(freq, int) and freq >= 1:
        return tuple(0 if (i + 1) % freq == 0 else 1 for i in range(num_layers))
    if isinstance(freq, (list, tuple)) and len(freq) == num_layers and not set(int(x) for x in freq) - {0, 1}:
        return tuple(int(x) for x in freq)
    raise ConvertError(f"linear_attention_freq={freq!r} is neither a positive int nor one 0/1 per layer "
                       f"({num_layers} layers)", "fix linear_attention_freq in the checkpoint args")


@dataclass(frozen=True, kw_only=True)
class T5(Feature):
    """megatron-core's T5Model: an encoder stack beside the decoder (the model's num_layers counts the decoder's)."""

    attr: ClassVar[str] = "t5"
    what: ClassVar[str] = "an encoder-decoder (T5) architecture"

    encoder_num_layers: int = setting(0, kind=SIZE, arg="encoder_num_layers", what="encoder layers")
    relative_attention_num_buckets: int = setting(32, kind=SIZE, arg="relative_attention_num_buckets",
                                                  what="relative position buckets")
    relative_attention_max_distance: int = setting(128, kind=SIZE, arg="relative_attention_max_distance",
                                                   what="relative position distance")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> T5:
        # an encoder as deep as the decoder unless the args say
        layers = int(get(vars(args), "encoder_num_layers", default=args.num_layers))
        return cls(**{**cls.args_values(args), "encoder_num_layers": layers})
