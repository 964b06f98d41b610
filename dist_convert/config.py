"""Model configuration of a GPT checkpoint, read from and written back to Megatron-LM ``args``."""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

from .errors import ConvertError
from .layout.topology import Layout

DEFAULT_DIVISIBLE_BY = 128  # Megatron-LM's --make-vocab-size-divisible-by default
# MambaModel's layer symbols -> (mixer, MLP) of the layer (megatron-core's hybrid layer allocation)
HYBRID_SYMBOLS: dict[str, tuple[str | None, str | None]] = {
    "M": ("mamba", None), "*": ("attention", None), "-": (None, "dense"), "E": (None, "moe")}


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    swiglu: bool
    normalization: str  # "RMSNorm" | "LayerNorm"
    add_bias_linear: bool
    add_qkv_bias: bool
    untie_embeddings_and_output_weights: bool
    vocab_size: int  # true (unpadded) vocabulary size
    make_vocab_size_divisible_by: int
    position_embedding_type: str  # "rope" | "learned_absolute" | "none"
    max_position_embeddings: int | None
    qk_layernorm: bool
    spec: str  # "local" | "te": layer-spec naming of the checkpoint
    family: str = "gpt"  # "gpt" (decoder only) | "t5" (encoder-decoder, megatron-core T5Model)
    encoder_num_layers: int = 0  # t5: encoder layers (num_layers counts the decoder's)
    relative_attention_num_buckets: int = 32  # t5 with relative position embeddings
    # Mixture of Experts (megatron-core MoELayer); num_experts 0: dense
    num_experts: int = 0
    moe_ffn_hidden_size: int | None = None  # per-expert FFN size (default: ffn_hidden_size)
    moe_layer_pattern: tuple[int, ...] | None = None  # 1: MoE layer, 0: dense (None: every layer MoE)
    moe_shared_expert_intermediate_size: int | None = None  # shared experts' FFN size (None: none)
    moe_shared_expert_gate: bool = False
    moe_router_expert_bias: bool = False  # router.expert_bias (kept in fp32 by megatron-core)
    moe_grouped: bool = False  # legacy files name experts as TEGroupedMLP does (linear_fc1.weight{i})
    # Multi-latent attention (megatron-core MLASelfAttention; DeepSeek-V2/V3): kv_channels is unused then
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None  # None: linear_q_proj (no query down-projection)
    kv_lora_rank: int = 0
    qk_head_dim: int = 0  # per-head query/key part without RoPE
    qk_pos_emb_head_dim: int = 0  # per-head RoPE part (k_pe is shared by all heads)
    v_head_dim: int = 0
    # the down-projections are split over TP (local spec, and Transformer Engine specs before the
    # ``duplicated`` TELinear) instead of replicated
    mla_down_split: bool = False
    mtp_num_layers: int = 0  # multi-token-prediction layers (megatron-core MultiTokenPredictionBlock)
    # the gate's activation of a gated (``swiglu``) MLP: "silu" | "gelu_tanh" (GeGLU) | "quick_gelu" (Megatron-LM's
    # --quick-geglu: x * sigmoid(1.702 x), gpt-oss's, with glu_linear_offset and activation_func_clamp_value in args)
    activation: str = "silu"
    zero_centered_gamma: bool = False  # norms compute x * (1 + w) (megatron-core layernorm_zero_centered_gamma)
    # sandwich norms (Gemma 2/3): a norm on the attention output and one on the MLP output, before each residual
    # add (Megatron-Bridge's TERowParallelLinearLayerNorm: linear_proj / linear_fc2 ``.post_layernorm``)
    post_norms: bool = False
    # the attention softmax (megatron-core ``softmax_type``): "vanilla", "off-by-one", or "learnable" (gpt-oss's
    # attention sinks: one learnt logit per head, ``core_attention.softmax_offset``)
    softmax_type: str = "vanilla"
    # hybrid stacks. MambaModel (Nemotron-H): one symbol per layer, "M" Mamba2 mixer, "*" attention, "-" MLP, "E" MoE
    # (megatron-core's hybrid_override_pattern / hybrid_layer_pattern); its final norm is decoder.final_norm
    hybrid_pattern: str | None = None
    mamba_num_heads: int = 0
    mamba_head_dim: int = 0
    mamba_num_groups: int = 0
    mamba_state_dim: int = 0
    # GPTModel with Gated DeltaNet layers (experimental_attention_variant "gated_delta_net"; Qwen3-Next/3.5):
    # 1 per GDN layer, 0 per (gated) full-attention layer
    linear_attention_pattern: tuple[int, ...] | None = None
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    attention_output_gate: bool = False  # linear_qkv holds a sigmoid gate per query head (fused.QKVG)

    @property
    def stacks(self) -> list[tuple[str, int]]:
        """Transformer stacks in model order: (module name, layers); the MTP layers are a stack of their own."""
        if self.family == "t5":
            return [("encoder", self.encoder_num_layers), ("decoder", self.num_layers)]
        return [("decoder", self.num_layers)] + ([("mtp", self.mtp_num_layers)] if self.mtp_num_layers else [])

    def layer_kind(self, stack: str, layer: int) -> tuple[str | None, str | None]:
        """(mixer, MLP) of a layer: mixer "attention" | "mamba" | "gdn" | None, MLP "dense" | "moe" | None.
        A hybrid (MambaModel) layer has one of the two; a GPTModel layer both."""
        if self.hybrid_pattern is not None and stack == "decoder":
            return HYBRID_SYMBOLS[self.hybrid_pattern[layer]]
        gdn = stack == "decoder" and self.linear_attention_pattern is not None \
            and bool(self.linear_attention_pattern[layer])
        return ("gdn" if gdn else "attention"), ("moe" if self.layer_is_moe(stack, layer) else "dense")

    @property
    def grouped_experts(self) -> bool:
        """Legacy rank files name routed experts as TEGroupedMLP does: as the source's did, and always for MambaModel
        (its layer spec builds TEGroupedMLP experts)."""
        return self.moe_grouped or self.hybrid_pattern is not None

    @property
    def mamba_d_inner(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def mamba_sections(self) -> tuple[tuple[str, int], ...]:
        """Mamba2 ``in_proj`` rows: [z | x | B | C | dt], each split over TP on its own."""
        di, gn = self.mamba_d_inner, self.mamba_num_groups * self.mamba_state_dim
        return (("z", di), ("x", di), ("B", gn), ("C", gn), ("dt", self.mamba_num_heads))

    @property
    def gdn_sections(self) -> tuple[tuple[str, int], ...]:
        """Gated DeltaNet ``in_proj`` rows: [query | key | value | z | beta | alpha], each split over TP on its own."""
        qk = self.linear_num_key_heads * self.linear_key_head_dim
        vd = self.linear_num_value_heads * self.linear_value_head_dim
        nv = self.linear_num_value_heads
        return (("query", qk), ("key", qk), ("value", vd), ("z", vd), ("beta", nv), ("alpha", nv))

    def layer_is_moe(self, stack: str, layer: int) -> bool:
        """Whether layer ``layer`` of ``stack`` has an MoE MLP (an MTP layer is built like the last decoder layer)."""
        if stack == "mtp":
            return self.is_moe_layer(self.num_layers - 1)
        return stack == "decoder" and self.is_moe_layer(layer)

    @property
    def mla(self) -> bool:
        return self.multi_latent_attention

    @property
    def q_head_dim(self) -> int:
        return self.qk_head_dim + self.qk_pos_emb_head_dim

    @property
    def attn_proj_cols(self) -> int:
        """Columns of linear_proj: the concatenated per-head attention outputs."""
        return self.num_attention_heads * (self.v_head_dim if self.mla else self.kv_channels)

    def check_layout(self, layout: Layout, what: str = "target") -> None:
        layout.validate(self.num_layers, self.num_attention_heads, self.num_query_groups, self.ffn_hidden_size, what,
                        encoder_layers=self.encoder_num_layers if self.family == "t5" else None,
                        mtp_layers=self.mtp_num_layers)
        if self.mla and self.mla_down_split:
            flag = "--target-tp" if what == "target" else "the source layout"
            for name, n in (("q_lora_rank", self.q_lora_rank or 0),
                            ("kv_lora_rank + qk_pos_emb_head_dim", self.kv_lora_rank + self.qk_pos_emb_head_dim)):
                if n % layout.tp:
                    raise ConvertError(f"{what} TP={layout.tp} does not divide {name}={n}: the {self.spec} spec "
                                       "splits MLA's down-projections over TP",
                                       f"choose {flag} among the divisors of {n}, or --target-spec te (which "
                                       "replicates them)")
        self._check_hybrid(layout, what)
        if self.num_experts:
            layout.validate_experts(self.num_experts, self.expert_ffn, self.moe_shared_expert_intermediate_size,
                                    what)
            if self.add_bias_linear and layout.expert_tp != 1:  # TransformerConfig.__post_init__ asserts it
                raise ConvertError(f"{what} ETP={layout.expert_tp}: megatron-core takes linear biases in MoE layers "
                                   "(gpt-oss's experts and router) only with expert tensor parallelism 1",
                                   "pass --target-etp 1")
        elif layout.ep != 1 or layout.etp is not None:
            raise ConvertError(f"{what} {layout} sets expert parallelism, but the model has no experts",
                               "drop --target-ep/--target-etp")

    def _check_hybrid(self, layout: Layout, what: str) -> None:
        """megatron-core splits a Mamba2 mixer by whole heads and groups, a Gated DeltaNet by whole key and value
        heads (MambaMixer / TransformerConfig assert it); MambaModel has no virtual pipeline stages."""
        flag = "--target-tp" if what == "target" else "the source layout"
        counts = (("mamba_num_heads", self.mamba_num_heads), ("mamba_num_groups", self.mamba_num_groups)) \
            if self.hybrid_pattern is not None else ()
        if self.linear_attention_pattern is not None:
            counts += (("linear_num_key_heads", self.linear_num_key_heads),
                       ("linear_num_value_heads", self.linear_num_value_heads))
        for name, n in counts:
            if n % layout.tp:
                raise ConvertError(f"{what} TP={layout.tp} does not divide {name}={n}: megatron-core splits the "
                                   "mixer by whole heads and groups", f"choose {flag} among the divisors of {n}")
        if self.hybrid_pattern is not None and (layout.vpp or layout.pipeline_layout):
            raise ConvertError(f"{what} {layout}: megatron-core's MambaModel builds no virtual pipeline stages "
                               "or layout strings", "drop --target-vpp / --target-pipeline-layout; use --target-pp "
                               "with --target-num-layers-in-first/last-stage")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` (0-based, global) is an MoE layer."""
        if self.hybrid_pattern is not None:
            return self.hybrid_pattern[layer] == "E"
        if not self.num_experts:
            return False
        return self.moe_layer_pattern is None or bool(self.moe_layer_pattern[layer])

    @property
    def expert_ffn(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    @property
    def expert_fc1_rows(self) -> int:
        return 2 * self.expert_ffn if self.swiglu else self.expert_ffn

    @property
    def shared_fc1_rows(self) -> int:
        n = self.moe_shared_expert_intermediate_size or 0
        return 2 * n if self.swiglu else n

    @property
    def qkv_rows(self) -> int:
        gate = self.num_attention_heads if self.attention_output_gate else 0
        return (self.num_attention_heads + gate + 2 * self.num_query_groups) * self.kv_channels

    @property
    def fc1_rows(self) -> int:
        return 2 * self.ffn_hidden_size if self.swiglu else self.ffn_hidden_size

    @property
    def has_norm_bias(self) -> bool:
        return self.normalization == "LayerNorm"

    @property
    def tied(self) -> bool:
        return not self.untie_embeddings_and_output_weights

    def padded_vocab(self, tp: int) -> int:
        return padded_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by, tp)

    def replace(self, **kw: Any) -> ModelConfig:
        return dataclasses.replace(self, **kw)


def padded_vocab_size(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron's rule: round up to a multiple of ``divisible_by * tp``."""
    if divisible_by < 1:
        raise ConvertError(f"make_vocab_size_divisible_by={divisible_by} is not a positive padding multiple",
                           "pass --make-vocab-size-divisible-by N with N >= 1 (e.g. 128)")
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def _get(args: argparse.Namespace, name: str, default: Any = None) -> Any:
    value = getattr(args, name, default)
    return default if value is None else value


def config_from_args(args: argparse.Namespace, vocab_size: int | None, spec: str | None,
                     source_tp: int, family: str = "gpt") -> ModelConfig:
    """Read the model config from Megatron-LM ``args`` (``family``: "gpt", or "t5" for an encoder-decoder).

    ``vocab_size`` (the ``--vocab-size`` flag) overrides the args. When neither gives the true vocab
    size, the padded size stands in for it; the caller refuses a target where that loses information.
    """
    missing = [n for n in ("num_layers", "hidden_size", "num_attention_heads") if getattr(args, n, None) is None]
    if missing:
        raise ConvertError(f"checkpoint args lack {', '.join(missing)}",
                           "the source must be a Megatron-LM / megatron-core GPT checkpoint with its args")
    heads = int(args.num_attention_heads)
    hidden = int(args.hidden_size)
    if hasattr(args, "group_query_attention"):  # Megatron-LM: num_query_groups counts only with GQA on
        groups = int(_get(args, "num_query_groups", heads)) if args.group_query_attention else heads
    else:
        groups = int(_get(args, "num_query_groups", heads))
    true_vocab = vocab_size or getattr(args, "vocab_size", None)
    if not true_vocab:
        padded = getattr(args, "padded_vocab_size", None)
        if padded is None:
            raise ConvertError("checkpoint args give neither vocab_size nor padded_vocab_size",
                               "pass the true vocabulary size with --vocab-size")
        true_vocab = int(padded)
    impl = _get(args, "transformer_impl", "transformer_engine")
    t5 = family == "t5"
    return ModelConfig(
        num_layers=int(_get(args, "decoder_num_layers", args.num_layers) if t5 else args.num_layers),
        hidden_size=hidden,
        ffn_hidden_size=int(_get(args, "ffn_hidden_size", 4 * hidden)),
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=int(_get(args, "kv_channels", hidden // heads)),
        swiglu=bool(_get(args, "swiglu", False)) or bool(_get(args, "quick_geglu", False)),
        normalization=str(_get(args, "normalization", "LayerNorm")),
        add_bias_linear=bool(_get(args, "add_bias_linear", True)),
        add_qkv_bias=bool(_get(args, "add_qkv_bias", False)) or bool(_get(args, "add_bias_linear", True)),
        untie_embeddings_and_output_weights=bool(_get(args, "untie_embeddings_and_output_weights", False)),
        vocab_size=int(true_vocab),
        make_vocab_size_divisible_by=int(_get(args, "make_vocab_size_divisible_by", DEFAULT_DIVISIBLE_BY)),
        position_embedding_type=str(_get(args, "position_embedding_type", "learned_absolute")),
        max_position_embeddings=_get(args, "max_position_embeddings", None),
        qk_layernorm=bool(_get(args, "qk_layernorm", False)),
        spec=spec or ("local" if impl == "local" else "te"),
        family=family,
        encoder_num_layers=int(_get(args, "encoder_num_layers", args.num_layers)) if t5 else 0,
        relative_attention_num_buckets=int(_get(args, "relative_attention_num_buckets", 32)),
        **_moe_from_args(args, int(args.num_layers)),
        **_mla_from_args(args, spec or ("local" if impl == "local" else "te")),
        mtp_num_layers=int(_get(args, "mtp_num_layers", 0) or 0),
        activation=_activation(args),
        zero_centered_gamma=bool(_get(args, "layernorm_zero_centered_gamma", False)
                                 or _get(args, "apply_layernorm_1p", False)),
        post_norms=bool(_get(args, "post_norms", False)),
        softmax_type=str(_get(args, "softmax_type", "vanilla")),
        attention_output_gate=bool(_get(args, "attention_output_gate", False)),
        **_hybrid_from_args(args),
    )


def _activation(args: argparse.Namespace) -> str:
    if _get(args, "quick_geglu", False):
        return "quick_gelu"
    if _get(args, "squared_relu", False):
        return "squared_relu"
    return str(_get(args, "glu_activation", "silu"))


def hybrid_pattern_of(pattern: str, num_layers: int | None = None) -> str:
    """The per-layer symbols of megatron-core's hybrid layer pattern (pipeline splits ``|`` dropped); refused in one
    line when a symbol is one megatron-core's MambaModel does not build here, or the count disagrees."""
    symbols = pattern.replace("|", "")
    bad = sorted(set(symbols) - set(HYBRID_SYMBOLS))
    if bad or not symbols:
        raise ConvertError(f"hybrid layer pattern {pattern!r} has symbol(s) {''.join(bad) or 'none'}: megatron-core's "
                           "MambaModel layers converted here are M (Mamba2), * (attention), - (MLP) and E (MoE)",
                           "convert a model whose hybrid_override_pattern uses only M, *, - and E (multi-token "
                           "prediction after '/' and G/D/+ layers are not supported)")
    if num_layers is not None and len(symbols) != num_layers:
        raise ConvertError(f"hybrid layer pattern {pattern!r} has {len(symbols)} layers but num_layers is {num_layers}",
                           "fix num_layers or the pattern in the checkpoint args")
    return symbols


def _hybrid_from_args(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    pattern = _get(args, "hybrid_layer_pattern", None) or _get(args, "hybrid_override_pattern", None)
    if pattern:
        out.update(hybrid_pattern=hybrid_pattern_of(str(pattern), int(args.num_layers)),
                   mamba_num_heads=int(_get(args, "mamba_num_heads", 0) or 0),
                   mamba_head_dim=int(_get(args, "mamba_head_dim", 64)),
                   mamba_num_groups=int(_get(args, "mamba_num_groups", 8)),
                   mamba_state_dim=int(_get(args, "mamba_state_dim", 128)))
        if not out["mamba_num_heads"]:  # megatron-core: d_inner = 2 * hidden (expand 2) without mamba_num_heads
            out["mamba_num_heads"] = 2 * int(args.hidden_size) // out["mamba_head_dim"]
    if _get(args, "experimental_attention_variant", None) == "gated_delta_net":
        out.update(linear_attention_pattern=linear_attention_pattern(_get(args, "linear_attention_freq", None),
                                                                     int(args.num_layers)),
                   linear_num_key_heads=int(_get(args, "linear_num_key_heads", 16)),
                   linear_num_value_heads=int(_get(args, "linear_num_value_heads", 32)),
                   linear_key_head_dim=int(_get(args, "linear_key_head_dim", 128)),
                   linear_value_head_dim=int(_get(args, "linear_value_head_dim", 128)),
                   linear_conv_kernel_dim=int(_get(args, "linear_conv_kernel_dim", 4)))
    elif _get(args, "experimental_attention_variant", None):
        raise ConvertError(f"experimental_attention_variant={args.experimental_attention_variant!r}: the variants "
                           "converted here are gated_delta_net", "convert a model of a supported layer kind")
    return out


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


def _mla_from_args(args: argparse.Namespace, spec: str) -> dict[str, Any]:
    if not _get(args, "multi_latent_attention", False):
        return {}
    q_lora = _get(args, "q_lora_rank", None)
    return {"multi_latent_attention": True, "q_lora_rank": int(q_lora) if q_lora else None,
            "kv_lora_rank": int(_get(args, "kv_lora_rank", 32)), "qk_head_dim": int(_get(args, "qk_head_dim", 128)),
            "qk_pos_emb_head_dim": int(_get(args, "qk_pos_emb_head_dim", 64)),
            "v_head_dim": int(_get(args, "v_head_dim", 128)), "mla_down_split": spec == "local"}


def moe_layer_pattern(freq: Any, num_layers: int) -> tuple[int, ...] | None:
    """megatron-core's ``moe_layer_freq``: an int k (every k-th layer, from layer 0, is MoE; 1: all)
    or a list of 0/1 per layer. None when every layer is MoE."""
    if freq is None or freq == 1:
        return None
    if isinstance(freq, int):
        if freq < 1:
            raise ConvertError(f"moe_layer_freq={freq} is not a positive layer frequency",
                               "the checkpoint args are damaged; fix moe_layer_freq")
        return tuple(1 if i % freq == 0 else 0 for i in range(num_layers))
    pattern = tuple(int(x) for x in freq)
    if len(pattern) != num_layers or set(pattern) - {0, 1}:
        raise ConvertError(f"moe_layer_freq={list(pattern)} is not one 0/1 per layer ({num_layers} layers)",
                           "the checkpoint args are damaged; fix moe_layer_freq")
    return pattern


def _moe_from_args(args: argparse.Namespace, num_layers: int) -> dict[str, Any]:
    experts = int(_get(args, "num_experts", 0) or 0)
    if not experts:
        return {}
    ffn = _get(args, "moe_ffn_hidden_size", None)
    shared = _get(args, "moe_shared_expert_intermediate_size", None)
    return {"num_experts": experts, "moe_ffn_hidden_size": int(ffn) if ffn else None,
            "moe_layer_pattern": moe_layer_pattern(_get(args, "moe_layer_freq", 1), num_layers),
            "moe_shared_expert_intermediate_size": int(shared) if shared else None,
            "moe_shared_expert_gate": bool(_get(args, "moe_shared_expert_gate", False)),
            "moe_router_expert_bias": bool(_get(args, "moe_router_enable_expert_bias", False))}
