"""The model configuration of a checkpoint: a small core (sizes, vocabulary, biases, layer-spec naming) and the
typed feature records of ``dist_convert.features``, read from and written back to Megatron-LM ``args``.

Every setting that changes the forward pass lives in exactly one record field, declared there with its
Megatron-LM name; ``ModelConfig.settings`` lists them all, which is what a Hugging Face family is compared with
field by field before an export (``models.export_family``)."""
from __future__ import annotations

import argparse
import dataclasses
import functools
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import ConvertError
from .features import (
    DSA,
    GDN,
    HYBRID_SYMBOLS,
    MLA,
    MLP,
    MTP,
    T5,
    Attention,
    Embedding,
    Feature,
    Mamba,
    MoE,
    Norms,
    Position,
    hybrid_pattern_of,
    linear_attention_freq,
    linear_attention_pattern,
    moe_layer_pattern,
)
from .features.audit import COVERED, NOT_MATH, UNCONVERTED, refuse_unconverted
from .features.base import LAYOUT, MODEL, SETTING, SIZE, MegatronArg, Setting, arg_name, get, setting
from .features.vision import Vision

if TYPE_CHECKING:  # a model config checks a layout by its attributes; the layout package is never imported here
    from .layout.topology import Layout

__all__ = ["DEFAULT_DIVISIBLE_BY", "HYBRID_SYMBOLS", "ModelConfig", "Setting", "config_from_args",
           "hybrid_pattern_of", "linear_attention_freq", "linear_attention_pattern", "moe_layer_pattern",
           "padded_vocab_size"]

DEFAULT_DIVISIBLE_BY = 128  # Megatron-LM's --make-vocab-size-divisible-by default
ALWAYS = ("position", "attention", "norm", "mlp", "embedding")  # records every model has
# records of the structural features (None: absent)
OPTIONAL = ("moe", "mla", "dsa", "mtp", "mamba", "gdn", "t5", "vision")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    num_layers: int = setting(0, kind=SIZE, arg="num_layers", what="layers (T5: the decoder's)",
                              mlm=MegatronArg("LCRB", MODEL, None))
    hidden_size: int = setting(0, kind=SIZE, arg="hidden_size", what="hidden size", mlm=MegatronArg("LCB", MODEL, None))
    ffn_hidden_size: int = setting(0, kind=SIZE, arg="ffn_hidden_size", what="the dense MLP's FFN size",
                                   mlm=MegatronArg("LB", MODEL, None))
    num_attention_heads: int = setting(0, kind=SIZE, arg="num_attention_heads", what="attention heads",
                                       mlm=MegatronArg("LCB", MODEL, None))
    num_query_groups: int = setting(0, kind=SIZE, arg="num_query_groups", what="key/value heads",
                                    mlm=MegatronArg("LB", MODEL, 1))
    kv_channels: int = setting(0, kind=SIZE, arg="kv_channels", what="head size", mlm=MegatronArg("LB", MODEL, None))
    vocab_size: int = setting(0, kind=SIZE, arg="vocab_size", what="the true (unpadded) vocabulary size",
                              mlm=MegatronArg("B", MODEL, None))
    make_vocab_size_divisible_by: int = setting(DEFAULT_DIVISIBLE_BY, kind=LAYOUT, arg="make_vocab_size_divisible_by",
                                                what="the vocabulary padding multiple", mlm=MegatronArg("CB", MODEL))
    untie_embeddings_and_output_weights: bool = setting(False, kind=SIZE, arg="untie_embeddings_and_output_weights",
                                                        config="share_embeddings_and_output_weights",
                                                        what="an output layer of its own", mlm=MegatronArg("LB", MODEL))
    max_position_embeddings: int | None = setting(None, kind=SIZE, arg="max_position_embeddings",
                                                  config="max_sequence_length", what="the context length",
                                                  mlm=MegatronArg("LCB", MODEL))
    add_bias_linear: bool = setting(False, arg="add_bias_linear", what="linear-layer biases",
                                    mlm=MegatronArg("LB", MODEL, True))
    add_qkv_bias: bool = setting(False, arg="add_qkv_bias", what="qkv biases", mlm=MegatronArg("LB", MODEL))
    spec: str = setting("te", kind=LAYOUT, arg="transformer_impl", what="layer-spec naming: local or te",
                        mlm=MegatronArg("B", MODEL, "transformer_engine"))
    family: str = setting("gpt", kind=SIZE, arg=(), what="the model: gpt (decoder only) or t5 (encoder-decoder; "
                                                          "its t5 record)")
    position: Position = Position()
    attention: Attention = Attention()
    norm: Norms = Norms()
    mlp: MLP = MLP()
    embedding: Embedding = Embedding()
    moe: MoE | None = None
    mla: MLA | None = None
    dsa: DSA | None = None
    mtp: MTP | None = None
    mamba: Mamba | None = None
    gdn: GDN | None = None
    t5: T5 | None = None
    vision: Vision | None = None

    def __post_init__(self) -> None:  # the family and the T5 record say the same
        if self.family == "t5" and self.t5 is None:
            object.__setattr__(self, "t5", T5())
        elif self.t5 is not None:
            object.__setattr__(self, "family", "t5")

    # -- the features ---------------------------------------------------------------------------------------
    def records(self) -> list[Feature]:
        """The feature records the model has, in ModelConfig order."""
        return [r for name in ALWAYS + OPTIONAL for r in [getattr(self, name)] if r is not None]

    def settings(self, kinds: tuple[str, ...] = (SETTING,)) -> list[Setting]:
        """Every setting that changes the math (``SETTING`` fields; ``kinds``: fields of those kinds): the core's,
        each record's present, whether each optional feature is present (then its fields)."""
        out = [Setting(f.name, getattr(self, f.name), f.default, arg_name(f), f.metadata["what"])
               for f in dataclasses.fields(self) if f.metadata.get("kind") in kinds]
        # whether each optional feature is there first: the most telling difference between two models
        out += [Setting(name, getattr(self, name) is not None, False, name, RECORDS[name].what) for name in OPTIONAL]
        for name in ALWAYS + OPTIONAL:
            record = getattr(self, name)
            if record is None:
                continue
            out += record.settings(name, kinds)
        return out

    def differences(self, other: ModelConfig) -> list[str]:
        """The settings and sizes on which two models differ (``key: this -> other``): what computes differently."""
        mine = {s.key: s.value for s in self.settings((SETTING, SIZE))}
        theirs = {s.key: s.value for s in other.settings((SETTING, SIZE))}
        unused = {"max_position_embeddings"} if self.max_position_embeddings is None else set()
        if self.mla is not None:
            unused.add("kv_channels")  # MLA's heads are sized by its own record
        if not any(self.layer_kind(stack, layer)[1] == "dense" for stack, n in self.stacks for layer in range(n)):
            unused.add("ffn_hidden_size")  # no dense MLP uses it
        return [f"{k}: {mine.get(k)!r} -> {theirs.get(k)!r}" for k in dict.fromkeys([*mine, *theirs])
                if mine.get(k) != theirs.get(k) and k not in unused]

    def replace(self, **kw: Any) -> ModelConfig:
        """A copy with fields changed; ``record__field=value`` changes one field of a record (``record__field__sub``
        one of the record a field holds)."""
        return _replaced(self, kw)

    # -- what the layout rules ask ------------------------------------------------------------------------
    @property
    def num_experts(self) -> int:
        return self.moe.num_experts if self.moe is not None else 0

    @property
    def mtp_num_layers(self) -> int:
        return self.mtp.num_layers if self.mtp is not None else 0

    @property
    def stacks(self) -> list[tuple[str, int]]:
        """Transformer stacks in model order: (module name, layers); the MTP layers are a stack of their own."""
        if self.t5 is not None:
            return [("encoder", self.t5.encoder_num_layers), ("decoder", self.num_layers)]
        return [("decoder", self.num_layers)] + ([("mtp", self.mtp_num_layers)] if self.mtp_num_layers else [])

    def layer_kind(self, stack: str, layer: int) -> tuple[str | None, str | None]:
        """(mixer, MLP) of a layer: mixer "attention" | "mamba" | "gdn" | None, MLP "dense" | "moe" | None.
        A hybrid (MambaModel) layer has one of the two; a GPTModel layer both."""
        if self.mamba is not None and stack == "decoder":
            return HYBRID_SYMBOLS[self.mamba.pattern[layer]]
        gdn = stack == "decoder" and self.gdn is not None and bool(self.gdn.pattern[layer])
        return ("gdn" if gdn else "attention"), ("moe" if self.layer_is_moe(stack, layer) else "dense")

    @property
    def grouped_experts(self) -> bool:
        """Legacy rank files name routed experts as TEGroupedMLP does: as the source's did, and always for MambaModel
        (its layer spec builds TEGroupedMLP experts)."""
        return (self.moe is not None and self.moe.grouped) or self.mamba is not None

    def layer_is_moe(self, stack: str, layer: int) -> bool:
        """Whether layer ``layer`` of ``stack`` has an MoE MLP (an MTP layer is built like the last decoder layer)."""
        if stack == "mtp":
            return self.is_moe_layer(self.num_layers - 1)
        return stack == "decoder" and self.is_moe_layer(layer)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` (0-based, global) is an MoE layer."""
        if self.mamba is not None:
            return self.mamba.pattern[layer] == "E"
        return self.moe is not None and self.moe.is_moe_layer(layer)

    @property
    def attn_proj_cols(self) -> int:
        """Columns of linear_proj: the concatenated per-head attention outputs."""
        return self.num_attention_heads * (self.mla.v_head_dim if self.mla else self.kv_channels)

    @property
    def expert_ffn(self) -> int:
        return self.moe.ffn if self.moe is not None and self.moe.ffn else self.ffn_hidden_size

    @property
    def expert_fc1_rows(self) -> int:
        return 2 * self.expert_ffn if self.mlp.gated else self.expert_ffn

    @property
    def shared_size(self) -> int:
        return (self.moe.shared_size or 0) if self.moe is not None else 0

    @property
    def shared_fc1_rows(self) -> int:
        return 2 * self.shared_size if self.mlp.gated else self.shared_size

    @property
    def qkv_rows(self) -> int:
        gate = self.num_attention_heads if self.attention.output_gate else 0
        return (self.num_attention_heads + gate + 2 * self.num_query_groups) * self.kv_channels

    @property
    def fc1_rows(self) -> int:
        return 2 * self.ffn_hidden_size if self.mlp.gated else self.ffn_hidden_size

    @property
    def tied(self) -> bool:
        return not self.untie_embeddings_and_output_weights

    def padded_vocab(self, tp: int) -> int:
        return padded_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by, tp)

    # -- layouts megatron-core builds ---------------------------------------------------------------------
    def check_layout(self, layout: Layout, what: str = "target") -> None:
        """Refuse, in one line, a ``what`` layout megatron-core does not build this model in: the core's limits
        (layers per stage, heads and FFN over TP), then each feature record's own (``Feature.check_layout``)."""
        layout.validate(self.num_layers, self.num_attention_heads, self.num_query_groups, self.ffn_hidden_size, what,
                        encoder_layers=self.t5.encoder_num_layers if self.t5 is not None else None,
                        mtp_layers=self.mtp_num_layers)
        for record in self.records():
            record.check_layout(self, layout, what)
        if self.moe is None and (layout.ep != 1 or layout.etp is not None):
            raise ConvertError(f"{what} {layout} sets expert parallelism, but the model has no experts",
                               "drop --target-ep/--target-etp")

    def needs_sequence_parallel(self, tp: int) -> bool:
        """Whether megatron-core builds the model only with sequence parallelism at this TP (its DSA attention,
        AbsorbedMLA, asserts it at TP > 1)."""
        return self.dsa is not None and tp > 1

    def has_indexer(self, stack: str, layer: int) -> bool:
        """Whether a layer of ``stack`` has a DeepSeek-sparse-attention indexer (``DSA.computes_topk``)."""
        return self.dsa is not None and stack in ("decoder", "mtp") and self.dsa.computes_topk(layer)

    # -- Megatron-LM args ---------------------------------------------------------------------------------
    def to_args(self) -> dict[str, Any]:
        """The Megatron-LM ``args`` fields that say this model (``config_from_args`` reads them back): the core's
        and every record's; an absent optional feature writes what says it is absent."""
        heads, groups = self.num_attention_heads, self.num_query_groups
        out: dict[str, Any] = {
            "hidden_size": self.hidden_size, "ffn_hidden_size": self.ffn_hidden_size, "num_attention_heads": heads,
            "group_query_attention": groups != heads, "num_query_groups": groups, "kv_channels": self.kv_channels,
            "add_bias_linear": self.add_bias_linear, "add_qkv_bias": self.add_qkv_bias,
            "untie_embeddings_and_output_weights": self.untie_embeddings_and_output_weights,
            "vocab_size": self.vocab_size, "make_vocab_size_divisible_by": self.make_vocab_size_divisible_by,
            "transformer_impl": "local" if self.spec == "local" else "transformer_engine"}
        for name in ALWAYS + OPTIONAL:
            record = getattr(self, name)
            if record is not None:
                out.update(record.to_args())
            else:
                out.update(RECORDS[name].absent_args())
        return out


RECORDS: dict[str, type[Feature]] = {c.attr: c for c in (Position, Attention, Norms, MLP, Embedding, MoE, MLA, DSA,
                                                          MTP, Mamba, GDN, T5, Vision)}
assert tuple(RECORDS) == ALWAYS + OPTIONAL


def _replaced(obj: Any, changes: dict[str, Any]) -> Any:
    """``obj`` (a dataclass) with ``changes``: ``name=value``, or ``name__field=value`` for the record ``name``
    holds."""
    nested: dict[str, dict[str, Any]] = defaultdict(dict)
    flat: dict[str, Any] = {}
    for k, v in changes.items():
        name, _, rest = k.partition("__")
        if rest:
            nested[name][rest] = v
        else:
            flat[k] = v
    for name, inner in nested.items():
        current = flat.get(name, getattr(obj, name))
        if current is None:
            raise ValueError(f"the model has no {name} record to change ({', '.join(inner)})")
        flat[name] = _replaced(current, inner)
    return dataclasses.replace(obj, **flat)


@functools.cache
def read_names() -> dict[str, str]:
    """megatron-core name -> the ModelConfig field (``record.field``, or a core field) that reads it (the ``config``
    names each field declares; an optional record's ``presence`` names)."""
    out: dict[str, str] = {}
    for f in dataclasses.fields(ModelConfig):
        if f.metadata.get("config") is not None:
            out.update(dict.fromkeys(f.metadata["config"], f.name))
    for name, cls in RECORDS.items():
        out.update(dict.fromkeys(cls.presence, name))
        for path, f in cls.leaf_fields():
            out.update(dict.fromkeys(f.metadata.get("config", ()), f"{name}.{path}"))
    return out


def classify(name: str) -> tuple[str, str]:
    """How the audit (``features.audit``) places a megatron-core name: ("read", the field), ("covered", the setting
    it goes with), ("unconverted", why), ("not_math", why) or ("missing", "")."""
    read = read_names()
    if name in read:
        return "read", read[name]
    if name in COVERED:
        return "covered", COVERED[name]
    if name in UNCONVERTED:
        return "unconverted", UNCONVERTED[name][1]
    if name in NOT_MATH:
        return "not_math", NOT_MATH[name]
    return "missing", ""


def padded_vocab_size(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron's rule: round up to a multiple of ``divisible_by * tp``."""
    if divisible_by < 1:
        raise ConvertError(f"make_vocab_size_divisible_by={divisible_by} is not a positive padding multiple",
                           "pass --make-vocab-size-divisible-by N with N >= 1 (e.g. 128)")
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def config_from_args(args: argparse.Namespace, vocab_size: int | None, spec: str | None,
                     source_tp: int, family: str = "gpt") -> ModelConfig:
    """Read the model config from Megatron-LM ``args`` (``family``: "gpt", or "t5" for an encoder-decoder).

    ``vocab_size`` (the ``--vocab-size`` flag) overrides the args. When neither gives the true vocab
    size, the padded size stands in for it; the caller refuses a target where that loses information.
    Settings dist_convert does not convert (``features.audit.UNCONVERTED``) are refused in one line."""
    missing = [n for n in ("num_layers", "hidden_size", "num_attention_heads") if getattr(args, n, None) is None]
    if missing:
        raise ConvertError(f"checkpoint args lack {', '.join(missing)}",
                           "the source must be a Megatron-LM / megatron-core GPT checkpoint with its args")
    refuse_unconverted(args)
    a = vars(args)
    heads = int(args.num_attention_heads)
    if heads < 1:
        raise ConvertError(f"num_attention_heads = {heads} in the checkpoint args has no meaning: attention has at "
                           "least one head", "the checkpoint args are damaged; fix num_attention_heads")
    hidden = int(args.hidden_size)
    if "group_query_attention" in a:  # Megatron-LM: num_query_groups counts only with GQA on
        groups = int(get(a, "num_query_groups", default=heads)) if args.group_query_attention else heads
    else:
        groups = int(get(a, "num_query_groups", default=heads))
    true_vocab = vocab_size or a.get("vocab_size")
    if not true_vocab:
        padded = a.get("padded_vocab_size")
        if padded is None:
            raise ConvertError("checkpoint args give neither vocab_size nor padded_vocab_size",
                               "pass the true vocabulary size with --vocab-size")
        true_vocab = int(padded)
    spec = spec or ("local" if get(a, "transformer_impl", default="transformer_engine") == "local" else "te")
    t5 = family == "t5"
    layers = int(get(a, "decoder_num_layers", default=args.num_layers) if t5 else args.num_layers)
    sized = argparse.Namespace(**{**a, "num_layers": layers})  # the records count the decoder's layers
    return ModelConfig(
        num_layers=layers, hidden_size=hidden, ffn_hidden_size=int(get(a, "ffn_hidden_size", default=4 * hidden)),
        num_attention_heads=heads, num_query_groups=groups, kv_channels=int(get(a, "kv_channels",
                                                                                default=hidden // heads)),
        vocab_size=int(true_vocab),
        make_vocab_size_divisible_by=int(get(a, "make_vocab_size_divisible_by", default=DEFAULT_DIVISIBLE_BY)),
        untie_embeddings_and_output_weights=bool(get(a, "untie_embeddings_and_output_weights", default=False)),
        max_position_embeddings=get(a, "max_position_embeddings"),
        add_bias_linear=bool(get(a, "add_bias_linear", default=True)),
        add_qkv_bias=bool(get(a, "add_qkv_bias", default=False)) or bool(get(a, "add_bias_linear", default=True)),
        spec=spec, family=family,
        position=Position.from_args(sized), attention=Attention.from_args(sized), norm=Norms.from_args(sized),
        mlp=MLP.from_args(sized), embedding=Embedding.from_args(sized), moe=MoE.from_args(sized),
        mla=MLA.from_args(sized, spec), dsa=DSA.from_args(sized), mtp=MTP.from_args(sized),
        mamba=Mamba.from_args(sized), gdn=GDN.from_args(sized), t5=T5.from_args(args) if t5 else None,
        vision=Vision.from_args(sized))
