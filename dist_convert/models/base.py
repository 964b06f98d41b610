"""What a model family declares, and the pieces Llama-shaped families share.

A family is one module under ``dist_convert/models/`` that subclasses :class:`Family` and declares, for
the engine to use:

- its Hugging Face ``architectures`` and ``model_type``;
- ``from_hf``: ``config.json`` -> (``ModelConfig``, Megatron-LM args, notes), refusing in one line what
  megatron-core cannot express;
- ``to_hf``: ``ModelConfig`` (+ args) -> ``config.json``; ``why_not``: what of a model it cannot express
  (the registry exports a model as the family that can, preferring the one it was imported from);
- ``layer_names`` / ``top_names``: its HF name table, each HF tensor given as (HF name, logical name,
  fused part), the parts being ``layout.fused``'s (``q``/``k``/``v`` of a QKV, ``gate``/``up`` of a GLU);
- optional special cases: stored copies checked on read (``stored_copies``), alternative stored layouts
  (``alternatives``).

Shared code (``formats/hf.py``, the planner, the executor) never branches on a family.
"""
from __future__ import annotations

import argparse
import copy
from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..config import DEFAULT_DIVISIBLE_BY, ModelConfig, padded_vocab_size
from ..errors import ConvertError
from ..layout.boxes import Piece
from ..layout.rules import EMBEDDING, LAYER_PREFIX, OUTPUT

# (HF name, logical name, fused part or None). In the per-layer tables the HF name is the suffix after
# ``model.layers.N.`` and the logical name the suffix after ``decoder.layers.N.``.
Name = tuple[str, str, str | None]
# HF name -> (stored shape, pieces of logical tensors)
HFTensors = dict[str, tuple[tuple[int, ...], list[Piece]]]

HF_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {v: k for k, v in HF_DTYPES.items()}
TOP_NAMES: tuple[tuple[str, str], ...] = (
    ("model.embed_tokens.weight", EMBEDDING),
    ("model.norm.weight", "decoder.final_layernorm.weight"),
    ("lm_head.weight", OUTPUT),
)
EXPORT_FIX = ("--dst-format hf takes only models a supported family expresses; export it with --dst-format "
              "torch_dist or megatron instead of hf")


@dataclass(frozen=True, kw_only=True)
class Imported:
    """What a family reads from ``config.json``."""

    cfg: ModelConfig
    args: argparse.Namespace
    notes: list[str]


class Family(ABC):
    """One Hugging Face architecture. Subclasses are frozen dataclasses declared in one module each; they
    must define ``from_hf``, ``to_hf``, ``why_not`` and ``layer_names`` (abstract here)."""

    architecture: str
    model_type: str
    scope: ClassVar[str] = "none of the supported Hugging Face families"
    hf_layers: ClassVar[str] = "model.layers."  # HF's prefix of layer N's tensors (before ``N.``)
    # HF layer suffix -> what HF's values exceed the logical (megatron-core's) ones by (a norm weight HF keeps as w
    # where megatron-core keeps w - 1); the engine adds it on the way, in the stored dtype
    shifts: ClassVar[dict[str, float]] = {}
    # stored name prefixes of parts a release carries and the family does not convert -> what they are (skipped on
    # read with a note, as transformers' own loader skips them)
    unconverted: ClassVar[dict[str, str]] = {}

    # -- config.json <-> model ---------------------------------------------------------------------------
    @abstractmethod
    def from_hf(self, hf: dict[str, Any], vocab_divisible_by: int | None) -> Imported:
        """``config.json`` -> model config, Megatron-LM args and notes; refuses what megatron-core cannot express."""

    @abstractmethod
    def to_hf(self, cfg: ModelConfig, args: argparse.Namespace, base: dict[str, Any] | None,
              dtype: torch.dtype) -> dict[str, Any]:
        """``config.json`` for the model; ``base``: the source's own config.json when it is of this family."""

    def affinity(self, cfg: ModelConfig) -> int:
        """How strongly the model's own evidence points at this family (0: not at all). The registry tries
        families in decreasing affinity; the first whose ``why_not`` is None exports the model."""
        return 0

    @abstractmethod
    def why_not(self, cfg: ModelConfig, args: argparse.Namespace) -> str | None:
        """What of the model this family cannot express (None: it expresses it)."""

    def refusal(self, problem: str) -> ConvertError:
        """The error when this family is the nearest and still cannot express the model."""
        return ConvertError(f"the model has {problem}, which {self.scope} can express", EXPORT_FIX)

    # -- names --------------------------------------------------------------------------------------------
    @abstractmethod
    def layer_names(self, cfg: ModelConfig, stack: str, layer: int) -> list[Name]:
        """(HF suffix after ``model.layers.N.``, full logical name, part) of every tensor of one layer of
        ``stack``, in HF order (HF numbers the layers of every stack on, from decoder layer 0)."""

    def top_names(self, cfg: ModelConfig) -> tuple[tuple[str, str], ...]:
        return TOP_NAMES

    def stored_copies(self, cfg: ModelConfig, found: Collection[str]) -> dict[str, list[str]]:
        """HF names stored as copies of another tensor, by the name they copy (compared on read)."""
        return {}

    def alternatives(self, cfg: ModelConfig, found: Collection[str], expected: HFTensors) -> HFTensors:
        """Other stored layouts of some tensors (e.g. all experts of a layer in one tensor) present in
        ``found``: {stored name: (shape, pieces)}; the expected names they replace are dropped."""
        return {}

    def as_stored(self, cfg: ModelConfig, args: argparse.Namespace, found: Collection[str],
                  notes: list[str]) -> ModelConfig:
        """The model as the weights hold it (``found``: the stored names), when ``config.json`` declares
        parts the weights lack; ``args`` and ``notes`` are updated to match."""
        return cfg

    def hf_layer(self, cfg: ModelConfig, stack: str, layer: int) -> int:
        """HF's layer number of layer ``layer`` of ``stack`` (MTP layers follow the decoder's)."""
        return layer if stack == "decoder" else cfg.num_layers + layer


# -- shared by the Llama-shaped families (GQA attention, gated MLP, RMSNorm, RoPE) ----------------------
ATTENTION_NAMES: tuple[Name, ...] = (
    ("input_layernorm.weight", "input_layernorm.weight", None),
    ("self_attn.q_proj.weight", "self_attention.linear_qkv.weight", "q"),
    ("self_attn.k_proj.weight", "self_attention.linear_qkv.weight", "k"),
    ("self_attn.v_proj.weight", "self_attention.linear_qkv.weight", "v"),
    ("self_attn.q_proj.bias", "self_attention.linear_qkv.bias", "q"),
    ("self_attn.k_proj.bias", "self_attention.linear_qkv.bias", "k"),
    ("self_attn.v_proj.bias", "self_attention.linear_qkv.bias", "v"),
    ("self_attn.q_norm.weight", "self_attention.q_layernorm.weight", None),
    ("self_attn.k_norm.weight", "self_attention.k_layernorm.weight", None),
    ("self_attn.o_proj.weight", "self_attention.linear_proj.weight", None),
)
# Llama's meaning of post_attention_layernorm: the norm before the MLP
MLP_NORM: tuple[Name, ...] = (("post_attention_layernorm.weight", "pre_mlp_layernorm.weight", None),)
DENSE_MLP: tuple[Name, ...] = (
    ("mlp.gate_proj.weight", "mlp.linear_fc1.weight", "gate"),
    ("mlp.up_proj.weight", "mlp.linear_fc1.weight", "up"),
    ("mlp.down_proj.weight", "mlp.linear_fc2.weight", None),
)
EXPERT_FC1 = "mlp.experts.local_experts.{e}.linear_fc1.weight"
EXPERT_FC2 = "mlp.experts.local_experts.{e}.linear_fc2.weight"


def in_layer(names: tuple[Name, ...] | list[Name], prefix: str) -> list[Name]:
    """Per-layer names with the logical suffixes made full names under ``prefix``."""
    return [(hf, prefix + lg, part) for hf, lg, part in names]


def expert_names(block: str, num_experts: int, proj: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                 ) -> list[Name]:
    """Per-expert gate/up/down of routed experts stored as ``{block}.experts.{e}.{proj}.weight``."""
    gate, up, down = proj
    out: list[Name] = []
    for e in range(num_experts):
        out += [(f"{block}.experts.{e}.{gate}.weight", EXPERT_FC1.format(e=e), "gate"),
                (f"{block}.experts.{e}.{up}.weight", EXPERT_FC1.format(e=e), "up"),
                (f"{block}.experts.{e}.{down}.weight", EXPERT_FC2.format(e=e), None)]
    return out


def layer_prefix(stack: str, layer: int) -> str:
    return f"{LAYER_PREFIX}{layer}." if stack == "decoder" else f"{stack}.layers.{layer}."


def get(hf: dict[str, Any], key: str, default: Any = None) -> Any:
    """``hf[key]``, or ``default`` when absent or null."""
    value = hf.get(key)
    return default if value is None else value


def require_int(hf: dict[str, Any], *keys: str, default: int | None = None) -> int:
    """The first of ``keys`` present in ``config.json``, as an int (or ``default``; refused without one)."""
    for k in keys:
        if hf.get(k) is not None:
            return int(hf[k])
    if default is None:
        raise ConvertError(f"config.json lacks {keys[0]}", "use the config.json saved with the model")
    return default


def hf_dtype(hf: dict[str, Any]) -> torch.dtype:
    return HF_DTYPES.get(str(hf.get("dtype") or hf.get("torch_dtype") or "float32"), torch.float32)


def rope_of(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope theta, scaling parameters or None), from transformers 4 or 5 style configs."""
    params = hf.get("rope_parameters") or {}
    theta = hf.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    return float(theta), scaling


@dataclass(frozen=True, kw_only=True)
class Dims:
    """The sizes every decoder config.json states."""

    heads: int
    hidden: int
    layers: int
    ffn: int
    vocab: int
    groups: int
    head_dim: int


def dims_of(hf: dict[str, Any]) -> Dims:
    try:
        heads, hidden = int(hf["num_attention_heads"]), int(hf["hidden_size"])
        layers, ffn, vocab = int(hf["num_hidden_layers"]), int(hf["intermediate_size"]), int(hf["vocab_size"])
    except KeyError as e:
        raise ConvertError(f"config.json lacks {e.args[0]}", "use the config.json saved with the model") from None
    return Dims(heads=heads, hidden=hidden, layers=layers, ffn=ffn, vocab=vocab,
                groups=int(hf.get("num_key_value_heads") or heads), head_dim=int(hf.get("head_dim") or hidden // heads))


def common_args(d: Dims, cfg: ModelConfig, dtype: torch.dtype, theta: float, hf: dict[str, Any],
                **extra: Any) -> argparse.Namespace:
    """Megatron-LM args every HF import states: sizes, vocabulary, RoPE, dtype, a TP1 PP1 layout."""
    return argparse.Namespace(
        num_layers=d.layers, hidden_size=d.hidden, ffn_hidden_size=d.ffn, num_attention_heads=d.heads,
        group_query_attention=cfg.num_query_groups != d.heads, num_query_groups=cfg.num_query_groups,
        kv_channels=cfg.kv_channels, swiglu=cfg.swiglu, normalization=cfg.normalization,
        norm_epsilon=float(get(hf, "rms_norm_eps", 1e-6)), add_bias_linear=cfg.add_bias_linear,
        add_qkv_bias=cfg.add_qkv_bias, qk_layernorm=cfg.qk_layernorm,
        untie_embeddings_and_output_weights=cfg.untie_embeddings_and_output_weights,
        vocab_size=d.vocab, make_vocab_size_divisible_by=cfg.make_vocab_size_divisible_by,
        padded_vocab_size=padded_vocab_size(d.vocab, cfg.make_vocab_size_divisible_by, 1),
        position_embedding_type="rope", use_rotary_position_embeddings=True, rotary_base=theta,
        rotary_percent=1.0, max_position_embeddings=cfg.max_position_embeddings,
        seq_length=cfg.max_position_embeddings, hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, transformer_impl="transformer_engine",
        tokenizer_type="HuggingFaceTokenizer", **extra)


def divisible(vocab_divisible_by: int | None) -> int:
    return vocab_divisible_by or DEFAULT_DIVISIBLE_BY


def structure_problems(cfg: ModelConfig, *, activation: str = "silu", gemma_norms: bool = False,
                       gqa_mtp: bool = False) -> list[str]:
    """What of a model no decoder family with a gated ``activation`` MLP, RMSNorm, RoPE and no linear biases
    expresses (the shape Llama, Mistral, Qwen and Gemma share); ``gemma_norms``: with Gemma's sandwich norms
    computing x * (1 + w) instead of plain pre-norms computing x * w; ``gqa_mtp``: the family stores
    multi-token-prediction layers over GQA attention (GLM-4.5), not only over multi-latent attention."""
    problems = []
    if cfg.post_norms != gemma_norms:
        problems.append("post-attention / post-feedforward norms" if cfg.post_norms else
                        "no post-attention / post-feedforward norms")
    if cfg.zero_centered_gamma != gemma_norms:
        problems.append("norms computing x * (1 + w) (zero-centred gamma)" if cfg.zero_centered_gamma else
                        "norms computing x * w (Gemma computes x * (1 + w))")
    if cfg.family != "gpt":
        problems.append(f"an encoder-decoder ({cfg.family.upper()}) architecture")
    if not cfg.swiglu:
        problems.append("a non-gated MLP")
    elif cfg.activation != activation:
        problems.append(f"a {cfg.activation}-gated MLP")
    if cfg.normalization != "RMSNorm":
        problems.append(f"{cfg.normalization}")
    if cfg.add_bias_linear:
        problems.append("linear-layer biases")
    if cfg.position_embedding_type != "rope":
        problems.append(f"{cfg.position_embedding_type} position embeddings")
    if cfg.mtp_num_layers and not cfg.mla and not gqa_mtp:
        problems.append("multi-token-prediction layers without multi-latent attention")
    if cfg.softmax_type != "vanilla":
        problems.append(f"an attention softmax of type {cfg.softmax_type!r} (attention sinks)")
    return problems + hybrid_problems(cfg)


def hybrid_problems(cfg: ModelConfig, *, gdn: bool = False) -> list[str]:
    """A hybrid stack's layers, which only the families built for them express (``gdn``: a family with Gated
    DeltaNet layers and gated attention, Qwen3-Next / Qwen3.5)."""
    problems = []
    if cfg.hybrid_pattern is not None:
        problems.append("Mamba2 layers (a MambaModel hybrid stack)")
    if (cfg.linear_attention_pattern is not None) != gdn:
        problems.append("Gated DeltaNet layers" if not gdn else "no Gated DeltaNet layers")
    if cfg.attention_output_gate != gdn:
        problems.append("attention output gates" if not gdn else "no attention output gates")
    return problems


def base_config(fam: Family, base: dict[str, Any] | None) -> tuple[dict[str, Any], bool]:
    """A copy of the source's config.json when it is of ``fam`` (and whether it was), else an empty dict."""
    same = isinstance(base, dict) and fam.architecture in (base.get("architectures") or [])
    return (copy.deepcopy(base) if same else {}), same
