"""Typed fused tensors: megatron-core fuses tensors that HF, NeMo 1 legacy and the serving formats keep
apart. Each fused tensor is declared once here, as named parts, each a set of row ranges (possibly one
per group), and every format takes its q/k/v or gate/up from these declarations:

* :class:`QKV`: ``linear_qkv``, group-major: for each query group g its ``heads // groups`` query heads,
  then its key head, then its value head (``head_dim`` rows each).
* :class:`GLU`: ``linear_fc1`` of a gated MLP (SwiGLU/GeGLU; dense, routed expert or shared expert),
  ``[gate; up]``.
* :class:`QKVG`: ``linear_qkv`` with an output gate (``attention_output_gate``, Qwen3-Next/3.5): per query group
  its query heads, the same heads' gates, its key and value head.
* :class:`GDNInProj`: a Gated DeltaNet's ``in_proj``, ``[q | k | v | z | beta | alpha]``.

A format may store several parts in one tensor in an order of its own: a *composite* part (``composites``) names
those parts and whether they interleave group by group (HF's ``q_proj`` of a gated attention: ``[q_h; gate_h]``
per head) or follow one another whole.

All of it is row algebra on dim 0 of the logical tensor: :meth:`Fused.pieces` gives boxes (each rank
reads only its slices), :meth:`Fused.moves` reorders stored rows, :meth:`Fused.tp_rows` gives what a
tensor-parallel rank holds; :meth:`Fused.split`, :meth:`Fused.fuse` and :meth:`Fused.unshard` are the
same algebra applied to whole tensors (the draft export, which gathers its small draft on one rank).

A new fused tensor (MLA's ``linear_kv_down_proj`` = [kv | k_pe], Mamba's ``in_proj`` = [z|x|B|C|dt],
Gated DeltaNet's q/k/v/z) is one more frozen dataclass naming its ``parts`` and its :meth:`Fused.blocks`;
the default :meth:`Fused.tp_rows` already splits each part separately over TP (override it where
megatron-core cuts the fused rows otherwise, as :class:`QKV` does).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from .boxes import Box, Piece, part_tp_rows

Extent = tuple[int, int]  # (first row, number of rows) on dim 0
Move = tuple[int, int, int]  # (source row, destination row, number of rows)


@dataclass(frozen=True, kw_only=True)
class Block:
    """Rows ``[start, start + rows)`` of a fused tensor hold rows of part ``part`` of group ``group``."""

    part: str
    group: int
    start: int
    rows: int


def row_box(shape: tuple[int, ...], start: int, rows: int) -> Box:
    """The box of ``rows`` whole rows (dim 0) of a tensor of ``shape``, from row ``start``."""
    return Box(offsets=(start,) + (0,) * (len(shape) - 1), sizes=(rows,) + tuple(shape[1:]))


class Fused(ABC):
    """A fused tensor: named parts, each a list of row blocks (one per group where the part is per group).

    Subclasses are frozen keyword-only dataclasses that set ``parts`` (in fused order) and define
    :meth:`blocks`; everything else derives from the blocks. A part's own row order is the order of its
    blocks in the fused tensor.
    """

    parts: ClassVar[tuple[str, ...]] = ()
    # name -> (parts, by group): a tensor holding several parts, group by group in the first part's group order
    # (each part's rows of that group), or each part whole after the other
    composites: ClassVar[dict[str, tuple[tuple[str, ...], bool]]] = {}

    @abstractmethod
    def blocks(self) -> list[Block]:
        """Every block, in fused row order; together they tile rows ``[0, total_rows)``."""

    @property
    def total_rows(self) -> int:
        return sum(b.rows for b in self.blocks())

    def rows(self, part: str, group: int | None = None) -> list[Extent]:
        """(fused row start, count) of ``part`` (of one group, or all), in the part's own row order; a composite
        part's rows are its parts' in its own order."""
        self._check(part)
        if part in self.composites:
            members, by_group = self.composites[part]
            if not by_group:
                return [e for m in members for e in self.rows(m, group)]
            groups = dict.fromkeys(b.group for b in self.blocks() if b.part == members[0])
            return [e for g in groups for m in members for e in self.rows(m, g)]
        return [(b.start, b.rows) for b in self.blocks() if b.part == part and group in (None, b.group)]

    def part_rows(self, part: str) -> int:
        """Rows of the tensor that holds ``part`` alone."""
        return sum(n for _, n in self.rows(part))

    def part_shape(self, lshape: tuple[int, ...], part: str) -> tuple[int, ...]:
        """Shape of the tensor that holds ``part`` alone, for a fused logical tensor of shape ``lshape``."""
        return (self.part_rows(part),) + tuple(lshape[1:])

    def moves(self, order: Sequence[str]) -> list[Move]:
        """Row moves ``(fused row, row, n)`` from the fused tensor to the tensor that stacks the parts
        ``order`` (each in its own row order), sorted by fused row. ``moves(("gate",))`` takes the gate
        alone; ``moves(("q", "k", "v"))`` gives NeMo's ``megatron_legacy`` [all q; all k; all v]."""
        out, dst = [], 0
        for part in order:
            for start, n in self.rows(part):
                out.append((start, dst, n))
                dst += n
        return sorted(out)

    def pieces(self, logical: str, lshape: tuple[int, ...], part: str) -> tuple[tuple[int, ...], list[Piece]]:
        """Shape of the tensor holding ``part`` of fused logical tensor ``logical`` (shape ``lshape``),
        and its pieces: which rows of the logical tensor each of its row ranges is."""
        self._check_rows(lshape[0])
        shape = self.part_shape(lshape, part)
        return shape, [Piece(logical=logical, lbox=row_box(lshape, src, n), sbox=row_box(shape, dst, n))
                       for src, dst, n in self.moves((part,))]

    def tp_rows(self, tp_rank: int, tp: int) -> list[Extent]:
        """Fused rows tensor-parallel rank ``tp_rank`` of ``tp`` holds, in the order they are stacked in
        its local tensor: by default each part is split into ``tp`` contiguous runs of its own rows
        separately, and a rank holds its run of every part, in part order (``[gate_r; up_r]``)."""
        for part in self.parts:
            if self.part_rows(part) % tp:
                raise ValueError(f"{type(self).__name__} part {part} of {self.part_rows(part)} rows does not "
                                 f"split over TP={tp}")
        return part_tp_rows([self.rows(part) for part in self.parts], tp_rank, tp)

    def split(self, fused: torch.Tensor) -> dict[str, torch.Tensor]:
        """A whole fused tensor cut into its parts (new contiguous tensors), in part order."""
        self._check_rows(fused.shape[0])
        return {part: torch.cat([fused[s:s + n] for s, n in self.rows(part)]) for part in self.parts}

    def fuse(self, **parts: torch.Tensor) -> torch.Tensor:
        """The fused tensor of whole parts (the inverse of :meth:`split`)."""
        if set(parts) != set(self.parts):
            raise ValueError(f"{type(self).__name__} fuses parts {', '.join(self.parts)}, got {', '.join(parts)}")
        first = parts[self.parts[0]]
        out = first.new_empty((self.total_rows,) + tuple(first.shape[1:]))
        for part, t in parts.items():
            if t.shape[0] != self.part_rows(part):
                raise ValueError(f"part {part} has {t.shape[0]} rows, expected {self.part_rows(part)}")
            for src, dst, n in self.moves((part,)):
                out[src:src + n] = t[dst:dst + n]
        return out

    def unshard(self, local: Sequence[torch.Tensor]) -> torch.Tensor:
        """The whole fused tensor from the local tensors of TP ranks 0..tp-1 (the inverse of :meth:`tp_rows`)."""
        out = local[0].new_empty((self.total_rows,) + tuple(local[0].shape[1:]))
        for r, t in enumerate(local):
            row = 0
            for start, n in self.tp_rows(r, len(local)):
                out[start:start + n] = t[row:row + n]
                row += n
            if row != t.shape[0]:
                raise ValueError(f"TP rank {r} holds {t.shape[0]} rows of {type(self).__name__}, expected {row}")
        return out

    def _check(self, part: str) -> None:
        if part not in self.parts and part not in self.composites:
            raise ValueError(f"{type(self).__name__} has parts {', '.join((*self.parts, *self.composites))}, "
                             f"not {part}")

    def _check_rows(self, rows: int) -> None:
        if rows != self.total_rows:
            raise ValueError(f"{self} has {self.total_rows} rows; the tensor has {rows}")


@dataclass(frozen=True, kw_only=True)
class QKV(Fused):
    """megatron-core's ``linear_qkv`` (weight or bias): per query group, ``heads // groups`` query heads,
    then one key and one value head, ``head_dim`` rows each. MHA: groups == heads; MQA: groups == 1."""

    parts: ClassVar[tuple[str, ...]] = ("q", "k", "v")
    # HF's concatenated ``attn.qkv`` (the Qwen-VL vision towers): all q rows, then all k, then all v
    composites: ClassVar[dict[str, tuple[tuple[str, ...], bool]]] = {"qkv": (("q", "k", "v"), False)}
    heads: int
    groups: int
    head_dim: int

    def __post_init__(self) -> None:
        if self.groups < 1 or self.heads % self.groups:
            raise ValueError(f"{self.heads} attention heads do not split into {self.groups} query groups")

    def blocks(self) -> list[Block]:
        d, per_group = self.head_dim, self.heads // self.groups
        sizes = {"q": per_group * d, "k": d, "v": d}
        out, row = [], 0
        for g in range(self.groups):
            for part in self.parts:
                out.append(Block(part=part, group=g, start=row, rows=sizes[part]))
                row += sizes[part]
        return out

    def tp_rows(self, tp_rank: int, tp: int) -> list[Extent]:
        """Rank ``tp_rank`` holds the contiguous ``tp_rank``-th 1/tp of the group-major rows (whole groups
        when TP divides the groups, part of one group when TP is a multiple of them)."""
        n, rem = divmod(self.total_rows, tp)
        if rem:
            raise ValueError(f"{self} does not split over TP={tp}")
        return [(tp_rank * n, n)]


@dataclass(frozen=True, kw_only=True)
class QKVG(QKV):
    """megatron-core's ``linear_qkv`` with ``attention_output_gate``: per query group, its ``heads // groups`` query
    heads, then those heads' output gates, then one key and one value head (``head_dim`` rows each). Query and
    gate blocks are numbered by head, key and value blocks by group; the composite ``q_gate`` is HF's ``q_proj``
    ([q_h; gate_h] per head). Under TP a rank holds a contiguous run of the group-major rows, as :class:`QKV`."""

    parts: ClassVar[tuple[str, ...]] = ("q", "gate", "k", "v")
    composites: ClassVar[dict[str, tuple[tuple[str, ...], bool]]] = {"q_gate": (("q", "gate"), True)}

    def blocks(self) -> list[Block]:
        d, per_group = self.head_dim, self.heads // self.groups
        out, row = [], 0
        for g in range(self.groups):
            heads = range(g * per_group, (g + 1) * per_group)
            for part, group in [*(("q", h) for h in heads), *(("gate", h) for h in heads), ("k", g), ("v", g)]:
                out.append(Block(part=part, group=group, start=row, rows=d))
                row += d
        return out


@dataclass(frozen=True, kw_only=True)
class GDNInProj(Fused):
    """A Gated DeltaNet's ``in_proj`` as megatron-core holds it: ``[q | k | v | z | beta | alpha]``, each part all
    heads in key-head order (key head g's q and k, then its ``v_heads // k_heads`` value heads' v, z, beta and alpha;
    blocks are numbered by key head). Composites: ``qkvz`` and ``ba`` interleave by key head (Qwen3-Next's
    ``in_proj_qkvz`` / ``in_proj_ba``), ``qkv`` is q, k, v whole (Qwen3.5's ``in_proj_qkv``). Each part splits over
    TP on its own (the default :meth:`Fused.tp_rows`)."""

    parts: ClassVar[tuple[str, ...]] = ("q", "k", "v", "z", "b", "a")
    composites: ClassVar[dict[str, tuple[tuple[str, ...], bool]]] = {
        "qkvz": (("q", "k", "v", "z"), True), "ba": (("b", "a"), True), "qkv": (("q", "k", "v"), False)}
    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int

    def __post_init__(self) -> None:
        if self.k_heads < 1 or self.v_heads % self.k_heads:
            raise ValueError(f"{self.v_heads} value heads do not split into {self.k_heads} key heads")

    def blocks(self) -> list[Block]:
        r = self.v_heads // self.k_heads
        sizes = {"q": self.k_dim, "k": self.k_dim, "v": r * self.v_dim, "z": r * self.v_dim, "b": r, "a": r}
        out, row = [], 0
        for part in self.parts:
            for g in range(self.k_heads):
                out.append(Block(part=part, group=g, start=row, rows=sizes[part]))
                row += sizes[part]
        return out


@dataclass(frozen=True, kw_only=True)
class GLU(Fused):
    """``linear_fc1`` of a gated MLP: ``[gate; up]``, ``ffn`` rows each. Under TP each rank holds
    ``[gate_r; up_r]`` (the default :meth:`Fused.tp_rows`)."""

    parts: ClassVar[tuple[str, ...]] = ("gate", "up")
    ffn: int

    def blocks(self) -> list[Block]:
        return [Block(part="gate", group=0, start=0, rows=self.ffn),
                Block(part="up", group=0, start=self.ffn, rows=self.ffn)]


class HeadConfig(Protocol):
    """What :func:`qkv` reads of a model config (a ModelConfig, or a draft model's config)."""

    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    attention: Any  # its Attention record (output_gate: whether the query projection also holds the gate)


def qkv(cfg: HeadConfig) -> QKV | QKVG:
    """The ``linear_qkv`` of a model config (with its output gates where ``attention_output_gate``)."""
    kind = QKVG if cfg.attention.output_gate else QKV
    return kind(heads=cfg.num_attention_heads, groups=cfg.num_query_groups, head_dim=cfg.kv_channels)


def gdn_in_proj(cfg) -> GDNInProj:  # a ModelConfig with Gated DeltaNet layers
    return GDNInProj(k_heads=cfg.gdn.num_key_heads, v_heads=cfg.gdn.num_value_heads,
                     k_dim=cfg.gdn.key_head_dim, v_dim=cfg.gdn.value_head_dim)


def glu(rows: int) -> GLU:
    """The ``[gate; up]`` ``linear_fc1`` of ``rows`` rows: a dense MLP's (``cfg.fc1_rows``), a routed
    expert's (``cfg.expert_fc1_rows``) or the shared experts' (``cfg.shared_fc1_rows``) of a gated model."""
    if rows % 2:
        raise ValueError(f"a gated linear_fc1 has [gate; up] rows, an even count, not {rows}")
    return GLU(ffn=rows // 2)


# name-table part -> its fused tensor. The gated attention's parts are q_gate (HF's q_proj) / k / v; a Gated
# DeltaNet's carry a ``gdn_`` prefix in the name tables (its own parts / composites after it), a vision tower's
# concatenated q/k/v ``vision_qkv``
OWNERS = {"q": "qkv", "k": "qkv", "v": "qkv", "q_gate": "qkv", "gate": "glu", "up": "glu",
          **{f"gdn_{p}": "gdn" for p in (*GDNInProj.parts, *GDNInProj.composites)}, "vision_qkv": "vision"}


def fused_for(part: str, cfg: HeadConfig, rows: int) -> Fused:
    """The fused tensor of ``rows`` rows that part ``part`` (a name-table entry: q, k, v, q_gate, gate, up,
    gdn_qkvz, ...) is of; :func:`part_in` gives the part's name in it."""
    owner = OWNERS.get(part)
    if owner is None:
        raise ValueError(f"no fused tensor has a part named {part} (known: {', '.join(OWNERS)})")
    if owner == "gdn":
        return gdn_in_proj(cfg)
    if owner == "vision":  # a vision tower's multi-head attention (layout/vision.py)
        v = cfg.vision
        return QKV(heads=v.heads, groups=v.heads, head_dim=v.head_dim)
    return qkv(cfg) if owner == "qkv" else glu(rows)


def part_in(part: str) -> str:
    """A name-table part's name in its fused tensor (``gdn_qkvz`` -> ``qkvz``)."""
    return part.removeprefix("gdn_").removeprefix("vision_")
