"""The logical model of a LoRA adapter (pure, no files).

An adapter is a list of *modules*, each adapting one stored weight ``X`` of the base ([out, in], in the naming of
the format the adapter was saved in: HF peft adapts ``model.layers.3.self_attn.q_proj``, Megatron-Bridge
``decoder.layers.3.self_attention.linear_qkv``) with ``dW_X = scale * B @ A``, ``A`` [r, in] and ``B`` [out, r].
A module's ``A`` and ``B`` are logical tensors of their own (the adapter format's names), moved by the engine like
any other; the module's ``base`` pieces say which box of which logical base tensor each box of ``X`` is (HF's
q_proj rows are rows of megatron-core's fused ``linear_qkv``), so one structure maps onto another through the
base (``structure.py``) and a merge adds each module's product where its base pieces land (``merge.py``).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction

from ..errors import ConvertError
from ..layout.boxes import Box, Piece

# megatron-core modules an adapter may wrap (Megatron-Bridge's LoRA target names), by the logical weight's suffix
MODULE_TYPES = {"self_attention.linear_qkv": "linear_qkv", "self_attention.linear_proj": "linear_proj",
                "mlp.linear_fc1": "linear_fc1", "mlp.linear_fc2": "linear_fc2"}
_ADAPTABLE = re.compile(r"^(?P<stack>decoder)\.layers\.(?P<layer>\d+)\.(?P<module>" +
                        "|".join(re.escape(m) for m in MODULE_TYPES) + r")\.weight$")


def module_type(logical: str) -> str | None:
    """Megatron-Bridge's target name of the module whose weight is logical tensor ``logical`` (None: LoRA on it is
    not supported: embeddings, norms, routers, MoE experts, MLA and Mamba projections)."""
    m = _ADAPTABLE.match(logical)
    return MODULE_TYPES[m.group("module")] if m else None


@dataclass(frozen=True, kw_only=True)
class AdapterModule:
    """One adapted weight ``X`` = ``name`` + ``.weight`` of shape ``shape`` (out, in): dW = scale * B @ A."""

    name: str  # the module, in the adapter format's naming
    a: str  # logical name of A [r, in]
    b: str  # logical name of B [out, r]
    r: int
    alpha: Fraction  # peft's lora_alpha / Bridge's alpha, as the config states it
    rslora: bool = False  # scale = alpha / sqrt(r) (peft use_rslora), else alpha / r
    shape: tuple[int, int]  # (out, in) of X
    base: tuple[Piece, ...]  # box of X -> box of a logical base tensor (2-D sboxes, no views)
    same_a: str | None = None  # an earlier module of the same fused tensor whose A is bitwise this one's, same scale

    @property
    def scale(self) -> float:
        return float(self.alpha) / math.sqrt(self.r) if self.rslora else float(self.alpha / self.r)

    @property
    def exact_scale(self) -> Fraction | None:
        """The scale as an exact fraction (None: irrational, rslora with r not a square)."""
        if not self.rslora:
            return self.alpha / self.r
        root = math.isqrt(self.r)
        return self.alpha / root if root * root == self.r else None

    @property
    def logicals(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p.logical for p in self.base))


@dataclass(frozen=True, kw_only=True)
class AdapterSpec:
    """A whole adapter: its modules and what its config says (for ``inspect`` and for targets that keep it)."""

    kind: str  # "peft" (HF peft directory) | "bridge" (Megatron-Bridge LoRA PEFT checkpoint)
    modules: tuple[AdapterModule, ...]
    base_ref: str | None = None  # base_model_name_or_path / checkpoint.pretrained_checkpoint
    config: dict | None = None  # adapter_config.json / run_config.yaml's peft: section, as read

    def logical_numel(self) -> dict[str, int]:
        out = {}
        for m in self.modules:
            out[m.a] = m.r * m.shape[1]
            out[m.b] = m.shape[0] * m.r
        return out

    def twin_a(self) -> frozenset[str]:
        """The A tensors a target leaves out: bitwise those of an earlier module of the same fused tensor
        (``same_a``, checked on read), which a fused adapter holds once."""
        return frozenset(m.a for m in self.modules if m.same_a is not None)

    def by_logical(self) -> dict[str, list[AdapterModule]]:
        """Logical base tensor -> the modules adapting boxes of it."""
        out: dict[str, list[AdapterModule]] = {}
        for m in self.modules:
            for name in m.logicals:
                out.setdefault(name, []).append(m)
        return out


def as_fraction(value: object, what: str, fix: str) -> Fraction:
    """A config's alpha as an exact fraction (floats by their exact binary value)."""
    if isinstance(value, Fraction) and value > 0:
        return value
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ConvertError(f"{what} is {value!r}, expected a positive number", fix)
    return Fraction(value)


def stored_at(p: Piece, o: Box) -> tuple[int, int]:
    """(row, column) of the adapted weight where its base piece ``p`` holds logical box ``o`` (inside ``p.lbox``)."""
    return p.sbox.offsets[0] + o.offsets[0] - p.lbox.offsets[0], p.sbox.offsets[1] + o.offsets[1] - p.lbox.offsets[1]


def identity_pieces(logical: str, shape: tuple[int, ...]) -> tuple[Piece, ...]:
    full = Box.full(shape)
    return (Piece(logical, full, full),)


def check_base_pieces(name: str, pieces: list[Piece]) -> tuple[Piece, ...]:
    """The pieces of the base weight ``name`` adapts, refused unless every one is a plain box of an adaptable
    logical weight (no transposed or strided storage, no shifted values)."""
    for p in pieces:
        kind = module_type(p.logical)
        if kind is None or p.view is not None or p.shift or len(p.sbox.sizes) != 2:
            raise ConvertError(f"LoRA on {name} (megatron-core {p.logical}) is not supported: adapters are read on "
                               "the attention's qkv / output and the dense MLP's fc1 / fc2 projections",
                               "train the adapter on those modules only (peft target_modules q_proj, k_proj, v_proj, "
                               "o_proj, gate_proj, up_proj, down_proj; Bridge linear_qkv, linear_proj, linear_fc1, "
                               "linear_fc2)")
    return tuple(pieces)
