"""Typed name-table rows: one row per logical (megatron-core) tensor, naming the Hugging Face tensors that hold it.

A row names a fused tensor's parts once, by their meaning (``QKV(q=, k=, v=)``, ``GLU(gate=, up=)``), and expands
into the (HF name, logical name, fused part) triples the hf format reads (``names``), in HF order: a fused row's parts
in the order its fields are declared, rows in table order. The parts are ``layout/fused.py``'s. A per-layer table
names suffixes (after ``model.layers.N.`` / ``decoder.layers.N.``): ``under`` puts prefixes before them. A name may
hold a wildcard for an index (``{e}`` for an expert, ``{i}`` for a tower block): ``each`` repeats rows over the
indexes, ``at`` fills one in.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import ClassVar, TypeVar

# (HF name, logical name, fused part or None): what a row expands into
Name = tuple[str, str, str | None]
TRANSPOSED = "transposed"  # a part: the whole logical tensor, stored transposed

R = TypeVar("R", bound="Row")


@dataclass(frozen=True, kw_only=True)
class Row:
    """One logical tensor (``logical``) and the HF tensors that hold it; a subclass declares its HF name fields and
    the fused part each one holds (``PARTS``, in HF order)."""

    logical: str
    PARTS: ClassVar[tuple[tuple[str, str | None], ...]] = ()  # (HF name field, part), in HF order

    def names(self) -> list[Name]:
        """(HF name, logical name, part) of each HF tensor of the row, in HF order."""
        return [(getattr(self, f), self.logical, part) for f, part in self.PARTS]

    def hf_names(self) -> list[str]:
        return [getattr(self, f) for f, _ in self.PARTS]

    def under(self: R, logical: str = "", hf: str = "") -> R:
        """The row with ``logical`` before its logical name and ``hf`` before each of its HF names."""
        return self._renamed(lambda n: hf + n, lambda n: logical + n)

    def at(self: R, **index: int) -> R:
        """The row with each wildcard ``{key}`` of its names (HF and logical) filled in with ``index[key]``."""
        def fill(name: str) -> str:
            for key, value in index.items():
                name = name.replace("{" + key + "}", str(value))
            return name
        return self._renamed(fill, fill)

    def _renamed(self: R, hf: Callable[[str], str], logical: Callable[[str], str]) -> R:
        return replace(self, logical=logical(self.logical), **{f: hf(getattr(self, f)) for f, _ in self.PARTS})


@dataclass(frozen=True, kw_only=True)
class Plain(Row):
    """A logical tensor HF stores whole, as it is."""

    hf: str
    PARTS: ClassVar = (("hf", None),)


@dataclass(frozen=True, kw_only=True)
class Transposed(Row):
    """A 2-D logical tensor HF stores whole, transposed (Gemma 3's ``mm_input_projection_weight``)."""

    hf: str
    PARTS: ClassVar = (("hf", TRANSPOSED),)


@dataclass(frozen=True, kw_only=True)
class QKV(Row):
    """megatron-core's ``linear_qkv`` (weight or bias: rows group-major) as HF's separate q, k and v."""

    q: str
    k: str
    v: str
    PARTS: ClassVar = (("q", "q"), ("k", "k"), ("v", "v"))


@dataclass(frozen=True, kw_only=True)
class GatedQKV(QKV):
    """A gated attention's ``linear_qkv`` (Qwen3-Next): HF's q holds each head's query and its output gate."""

    PARTS: ClassVar = (("q", "q_gate"), ("k", "k"), ("v", "v"))


@dataclass(frozen=True, kw_only=True)
class StackedQKV(Row):
    """A vision tower's ``linear_qkv`` as HF's one tensor of all q, then all k, then all v."""

    hf: str
    PARTS: ClassVar = (("hf", "vision_qkv"),)


@dataclass(frozen=True, kw_only=True)
class GLU(Row):
    """A gated ``linear_fc1`` ([gate; up]) as HF's separate gate and up projections."""

    gate: str
    up: str
    PARTS: ClassVar = (("gate", "gate"), ("up", "up"))


@dataclass(frozen=True, kw_only=True)
class GDNFused(Row):
    """A Gated DeltaNet's ``in_proj`` as Qwen3-Next's two tensors: q/k/v/z per key-head group, then b/a."""

    qkvz: str
    ba: str
    PARTS: ClassVar = (("qkvz", "gdn_qkvz"), ("ba", "gdn_ba"))


@dataclass(frozen=True, kw_only=True)
class GDNSplit(Row):
    """A Gated DeltaNet's ``in_proj`` as Qwen3.5's four tensors: q/k/v, z, b and a."""

    qkv: str
    z: str
    b: str
    a: str
    PARTS: ClassVar = (("qkv", "gdn_qkv"), ("z", "gdn_z"), ("b", "gdn_b"), ("a", "gdn_a"))


def names(rows: Iterable[Row], logical: str = "", hf: str = "") -> list[Name]:
    """The triples of ``rows``, in order, with ``logical`` before each logical name and ``hf`` before each HF name."""
    return [n for row in rows for n in row.under(logical, hf).names()]


def under(rows: Iterable[R], logical: str = "", hf: str = "") -> list[R]:
    return [row.under(logical, hf) for row in rows]


def each(rows: Iterable[R], **indexes: Iterable[int]) -> list[R]:
    """``rows`` once per index of the one wildcard named (``each(rows, e=range(4))``), index-major."""
    (key, values), = indexes.items()
    rows = tuple(rows)
    return [row.at(**{key: i}) for i in values for row in rows]
