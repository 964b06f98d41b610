"""What a model family declares, and the pieces Llama-shaped families share.

A family is one module under ``dist_convert/models/`` that subclasses :class:`Family` and declares, for
the engine to use:

- its Hugging Face ``architectures`` and ``model_type``;
- ``from_hf``: ``config.json`` -> ``ModelConfig`` (its feature records) and notes, refusing in one line what
  megatron-core cannot express; ``hf_keys``: the config.json keys that change the math which it maps (or refuses
  itself). Any other such key (``models.hf_keys.HF_MATH_KEYS``) with a value that changes the math is refused for
  it, never ignored;
- ``to_hf``: ``ModelConfig`` -> ``config.json``; ``expresses``: the value of every setting it writes, positively
  (``ModelConfig.settings``; a setting it does not name must hold its plain value). Export compares the model with
  that declaration field by field (``unexpressed``): a value no family expresses is refused in one line;
- ``layer_names`` / ``top_names`` / ``component_names`` (a vision tower's): its HF name table, typed rows
  (``models/rows.py``: ``Plain``, ``QKV(q=, k=, v=)``, ``GLU(gate=, up=)``, ``Transposed``, ...), one per logical
  tensor, each naming the HF tensors that hold it and expanding into (HF name, logical name, fused part) triples;
- optional special cases: stored copies checked on read (``stored_copies``), alternative stored layouts
  (``alternatives``), optional stored tensor sets a release may or may not carry (``optional_sets``: a round trip
  gives them back as the source had them).

Shared code (``formats/hf.py``, the planner, the executor) never branches on a family.
"""
from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..config import DEFAULT_DIVISIBLE_BY, ModelConfig
from ..errors import ConvertError
from ..features.base import Setting
from ..features.base import get as features_get
from ..features.expressed import ANY, Allowed, describe_all, unexpressed
from ..layout.boxes import Box, Piece, View
from ..layout.fused import fused_for, part_in
from ..layout.rules import EMBEDDING, LAYER_PREFIX, OUTPUT
from .rows import GLU, QKV, TRANSPOSED, Plain, Row, each

# HF name -> (stored shape, pieces of logical tensors)
HFTensors = dict[str, tuple[tuple[int, ...], list[Piece]]]

HF_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {v: k for k, v in HF_DTYPES.items()}
TOP_NAMES: tuple[tuple[str, str], ...] = (
    ("model.embed_tokens.weight", EMBEDDING),
    ("model.norm.weight", "decoder.final_layernorm.weight"),
    ("lm_head.weight", OUTPUT),
)
TIED_HEAD = "tied lm_head"  # the optional set of a tied model's output head stored as a copy of the embedding
EXPORT_FIX = ("--dst-format hf takes only models a supported family expresses; export it with --dst-format "
              "torch_dist or megatron instead of hf")


# what every family writes: the RoPE base and the norm epsilon (rope_theta, rms_norm_eps)
COMMON: dict[str, Allowed] = {"position.base": ANY, "norm.eps": ANY}
COMMON_HF_KEYS = frozenset({"rope.rope_theta", "rms_norm_eps", "tie_word_embeddings"})


@dataclass(frozen=True, kw_only=True)
class Imported:
    """What a family reads from ``config.json``."""

    cfg: ModelConfig
    notes: list[str]


class Family(ABC):
    """One Hugging Face architecture. Subclasses are frozen dataclasses declared in one module each; they
    must define ``from_hf``, ``to_hf``, ``expresses`` and ``layer_names`` (abstract here)."""

    architecture: str
    model_type: str
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
        """``config.json`` -> model config and notes; refuses what megatron-core cannot express."""

    @property
    def hf_keys(self) -> frozenset[str]:
        """The config.json keys of ``hf_keys.HF_MATH_KEYS`` this family maps (or refuses itself)."""
        return COMMON_HF_KEYS

    @abstractmethod
    def to_hf(self, cfg: ModelConfig, base: dict[str, Any] | None, dtype: torch.dtype) -> dict[str, Any]:
        """``config.json`` for the model; ``base``: the source's own config.json when it is of this family."""

    @abstractmethod
    def expresses(self) -> Mapping[str, Allowed]:
        """``record.field`` (or a core field, or an optional feature's name) -> the values ``to_hf`` writes. A
        setting not named here is expressed only at its plain value (the field's default)."""

    def unexpressed(self, cfg: ModelConfig) -> list[Setting]:
        """The model's settings this family cannot write (empty: it expresses the model)."""
        return unexpressed(cfg, self.expresses())

    def refusal(self, problems: list[Setting]) -> ConvertError:
        """The error when this family is the nearest and still cannot express the model."""
        return ConvertError(f"the model has {describe_all(problems)}, which none of the supported Hugging Face "
                            f"families expresses (nearest: {self.architecture})", EXPORT_FIX)

    # -- names --------------------------------------------------------------------------------------------
    @abstractmethod
    def layer_names(self, cfg: ModelConfig, stack: str, layer: int) -> list[Row]:
        """The rows of every tensor of one layer of ``stack`` (HF names: the suffixes after ``model.layers.N.``;
        logical names: full), in HF order (HF numbers the layers of every stack on, from decoder layer 0)."""

    def top_names(self, cfg: ModelConfig) -> tuple[tuple[str, str], ...]:
        return TOP_NAMES

    def component_names(self, cfg: ModelConfig) -> list[Row]:
        """The rows (full names) of every tensor of the model's components beside the language model (a vision
        tower and its projectors: ``layout/vision.py``), in HF order; none for a text model."""
        return []

    def stored_copies(self, cfg: ModelConfig, found: Collection[str]) -> dict[str, list[str]]:
        """HF names stored as copies of another tensor, by the name they copy (compared on read)."""
        return {}

    def optional_sets(self, cfg: ModelConfig) -> dict[str, tuple[list[str], bool]]:
        """Sets of stored tensors a release of this family may carry or not (copies of another tensor): set name
        -> (its HF names, whether an export writes it when nothing says otherwise). A source records which it
        carried (``Origin.hf_stored``); an export writes them back as the source had them. Every family: a tied
        model's ``lm_head.weight``, which transformers' ``save_pretrained`` does not store."""
        return {TIED_HEAD: (["lm_head.weight"], False)} if cfg.tied else {}

    def alternatives(self, cfg: ModelConfig, found: Collection[str], expected: HFTensors) -> HFTensors:
        """Other stored layouts of some tensors (e.g. all experts of a layer in one tensor) present in
        ``found``: {stored name: (shape, pieces)}; the expected names they replace are dropped."""
        return {}

    def as_stored(self, cfg: ModelConfig, found: Collection[str], notes: list[str]) -> ModelConfig:
        """The model as the weights hold it (``found``: the stored names), when ``config.json`` declares
        parts the weights lack; ``notes`` say what changed."""
        return cfg

    def hf_layer(self, cfg: ModelConfig, stack: str, layer: int) -> int:
        """HF's layer number of layer ``layer`` of ``stack`` (MTP layers follow the decoder's)."""
        return layer if stack == "decoder" else cfg.num_layers + layer


# -- shared by the Llama-shaped families (GQA attention, gated MLP, RMSNorm, RoPE) ----------------------
INPUT_NORM = Plain(hf="input_layernorm.weight", logical="input_layernorm.weight")
QKV_WEIGHT = QKV(logical="self_attention.linear_qkv.weight", q="self_attn.q_proj.weight", k="self_attn.k_proj.weight",
                 v="self_attn.v_proj.weight")
QKV_BIAS = QKV(logical="self_attention.linear_qkv.bias", q="self_attn.q_proj.bias", k="self_attn.k_proj.bias",
               v="self_attn.v_proj.bias")
QK_NORMS = (Plain(hf="self_attn.q_norm.weight", logical="self_attention.q_layernorm.weight"),
            Plain(hf="self_attn.k_norm.weight", logical="self_attention.k_layernorm.weight"))
O_PROJ = Plain(hf="self_attn.o_proj.weight", logical="self_attention.linear_proj.weight")
ATTENTION: tuple[Row, ...] = (INPUT_NORM, QKV_WEIGHT, QKV_BIAS, *QK_NORMS, O_PROJ)
# Llama's meaning of post_attention_layernorm: the norm before the MLP
PRE_MLP_NORM: tuple[Row, ...] = (Plain(hf="post_attention_layernorm.weight", logical="pre_mlp_layernorm.weight"),)
GATED_MLP: tuple[Row, ...] = (
    GLU(logical="mlp.linear_fc1.weight", gate="mlp.gate_proj.weight", up="mlp.up_proj.weight"),
    Plain(hf="mlp.down_proj.weight", logical="mlp.linear_fc2.weight"),
)
EXPERT_FC1 = "mlp.experts.local_experts.{e}.linear_fc1.weight"
EXPERT_FC2 = "mlp.experts.local_experts.{e}.linear_fc2.weight"


def part_pieces(logical: str, lshape: tuple[int, ...], part: str | None,
                cfg: ModelConfig) -> tuple[tuple[int, ...], list[Piece]]:
    """Shape of the HF tensor holding ``part`` of a fused logical tensor, and its pieces (``layout/fused.py``
    declares the parts: q/k/v of ``linear_qkv``, gate/up of a gated ``linear_fc1``; ``TRANSPOSED``: the whole
    tensor, transposed)."""
    if part is None:
        full = Box.full(lshape)
        return lshape, [Piece(logical, full, full)]
    if part == TRANSPOSED:  # a 2-D tensor HF stores as its transpose (Gemma 3's mm_input_projection_weight)
        shape = (lshape[1], lshape[0])
        return shape, [Piece(logical, Box.full(lshape), Box.full(shape), view=View(axes=(1, 0), steps=(1, 1)))]
    return fused_for(part, cfg, lshape[0]).pieces(logical, lshape, part_in(part))


def in_layer(rows: tuple[Row, ...] | list[Row], prefix: str) -> list[Row]:
    """Per-layer rows with the logical suffixes made full names under ``prefix``."""
    return [row.under(prefix) for row in rows]


def expert_names(block: str, num_experts: int, proj: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                 ) -> list[Row]:
    """Per-expert gate/up/down of routed experts stored as ``{block}.experts.{e}.{proj}.weight``."""
    gate, up, down = (f"{block}.experts.{{e}}.{p}.weight" for p in proj)
    return each((GLU(logical=EXPERT_FC1, gate=gate, up=up), Plain(hf=down, logical=EXPERT_FC2)), e=range(num_experts))


def layer_prefix(stack: str, layer: int) -> str:
    return f"{LAYER_PREFIX}{layer}." if stack == "decoder" else f"{stack}.layers.{layer}."


def get(hf: dict[str, Any], key: str, default: Any = None) -> Any:
    """``hf[key]``, or ``default`` when absent or null."""
    return features_get(hf, key, default=default)


def check_silu(hf: dict[str, Any]) -> None:
    """Refuse an MLP activation other than SiLU (the SwiGLU every such family's megatron-core model builds)."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ConvertError(f"hidden_act={hf['hidden_act']!r} is not supported", "only SiLU-gated (SwiGLU) MLPs convert")


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
    for key, n in (("num_attention_heads", heads), ("num_key_value_heads", hf.get("num_key_value_heads", 1))):
        if n is not None and int(n) < 1:  # transformers divides by both: it builds no model
            raise ConvertError(f"{key} = {n} in config.json has no meaning: attention has at least one head",
                               "use the config.json saved with the model")
    return Dims(heads=heads, hidden=hidden, layers=layers, ffn=ffn, vocab=vocab,
                groups=int(hf.get("num_key_value_heads") or heads), head_dim=int(hf.get("head_dim") or hidden // heads))


def hf_window(size: Any) -> tuple[int, int]:
    """megatron-core's ``window_size`` (W - 1, 0) for config.json's ``sliding_window`` W on layers that slide (each
    query sees itself and the W - 1 tokens before it). W below 1 is refused: transformers' mask of W tokens then
    holds none and its forward fails (megatron-core's own (0, 0), the token itself alone, is W = 1)."""
    if isinstance(size, bool) or not isinstance(size, (int, float)) or size < 1:
        raise ConvertError(f"sliding_window = {size!r} in config.json has no meaning: a sliding window holds at "
                           "least the token itself (1)", "set sliding_window in config.json to the window the "
                                                         "model was trained with")
    return int(size) - 1, 0


def divisible(vocab_divisible_by: int | None) -> int:
    return vocab_divisible_by or DEFAULT_DIVISIBLE_BY


def base_config(fam: Family, base: dict[str, Any] | None) -> tuple[dict[str, Any], bool]:
    """A copy of the source's config.json when it is of ``fam`` (and whether it was), else an empty dict."""
    same = isinstance(base, dict) and fam.architecture in (base.get("architectures") or [])
    return (copy.deepcopy(base) if same else {}), same
